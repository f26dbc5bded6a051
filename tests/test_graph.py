"""Graph: building by hand, reading it back, refusals."""

from __future__ import annotations

import json

import pytest
from _nodes import Add, Join, Same

from somatize import Graph, Node


def test_building_by_hand():
    g = Graph()
    a = g.node(Add())
    b = g.node("second", Add(2))
    g.edge(a, b)
    assert (a, b) == ("add", "second")
    assert g.forward(1) == 4
    assert len(g) == 2 and "second" in g and "nope" not in g
    assert repr(g) == "Graph(2 nodes, 1 edges)"


def test_duplicate_id_is_refused_naming_it():
    g = Graph()
    g.node("x", Add())
    with pytest.raises(ValueError, match="'x'"):
        g.node("x", Same())
    with pytest.raises(ValueError, match="duplicate node id 'x'"):
        Graph.somatize(Add().named("x") >> Same().named("x"))

    def double(v):
        return 2 * v

    with pytest.raises(ValueError, match="a Add already has it; give this double another"):
        g.node("x", Node.of(double))  # a function as it is goes by its own name


def test_an_id_given_to_g_node_is_checked_as_named_checks_it():
    g = Graph()
    for bad in ("a/b", "a.b", ""):
        with pytest.raises(ValueError, match="a node id must be a non-empty string"):
            g.node(bad, Add())
    with pytest.raises(ValueError, match="g.node adds one node; this expression holds 2"):
        g.node("x", Add() >> Add())
    assert len(g) == 0


def test_an_edge_closing_a_cycle_is_refused_and_the_graph_is_unchanged():
    g = Graph.somatize(Add() >> Add() >> Add())
    before = g.edges()
    with pytest.raises(ValueError, match="cycle"):
        g.edge("add_3", "add")
    with pytest.raises(ValueError, match="cycle"):
        g.edge("add", "add")
    assert g.edges() == before
    assert g.forward(0) == 3


def test_unknown_device_is_refused_when_built():
    piece = Add().on("gpu7")  # declaring is fine
    with pytest.raises(ValueError, match="'gpu7'.*'cuda:N'"):
        Graph.somatize(piece)


def test_readers():
    g = Graph.somatize(Add() >> (Add().named("l") | Same().named("r")) >> Join())
    assert g.predecessors("join") == ["l", "r"]
    assert g.successors("add") == ["l", "r"]
    assert g.topological_sort() == ["add", "l", "r", "join"]
    assert isinstance(g.implementation("join"), Join)
    with pytest.raises(KeyError, match="nope"):
        g.implementation("nope")
    assert g.devices() == {} and g.hosts() == {}  # nothing was placed
    assert g.frozen() == {} and g.cached() == {} and g.mapped_nodes() == []


def test_devices_and_hosts_list_only_the_nodes_that_were_placed():
    g = Graph.somatize(
        Add().on("cpu") >> (Add().named("l").at("far") | Same().named("r")) >> Join()
    )
    assert g.devices() == {"add": "cpu"}
    assert g.hosts() == {"l": "far"}
    g.declare("r", device="meta", host="near")
    assert g.devices() == {"add": "cpu", "r": "meta"}
    assert g.hosts() == {"l": "far", "r": "near"}


def test_a_default_id_keeps_to_what_named_allows_whatever_the_class_is_called():
    g = Graph()
    odd = [type(name, (Add,), {}) for name in ("my.Add", "a/b", "")]
    assert [g.node(kind()) for kind in odd] == ["my_add", "a_b", "node"]
    for nid in g.nodes():
        Add().named(nid)  # each passes the check an id given by hand passes


def test_a_node_auto_named_from_a_dotted_class_owns_its_parameters():
    from torch import nn

    from somatize.torch import parameters
    from somatize.torch.training.params import owners

    g = Graph()
    nid = g.node(Node.of(type("pkg.Lin", (nn.Linear,), {})(2, 2)))
    assert set(owners(g).values()) == {nid} and len(parameters(g)) == 2


def test_default_ids_skip_an_explicit_name_already_taken():
    g = Graph.somatize(Add().named("add_2") >> Add() >> Add())
    assert g.nodes() == ["add_2", "add", "add_3"]


def test_plan_text_and_json_agree():
    g = Graph.somatize(Add().cached() >> (Add() | Same().at("far")) >> Join())
    data = g.plan_json()
    json.dumps(data)  # plain data
    assert data["order"] == g.topological_sort()
    assert [n["id"] for n in data["nodes"]] == g.nodes()
    far = next(n for n in data["nodes"] if n["id"] == "same")
    assert far["host"] == "far" and far["kind"] == "Same"
    text = g.plan()
    assert "at far" in text and "cached" in text and "join (Join) <- add_2, same" in text


def test_topology_change_recompiles_the_plan():
    g = Graph()
    g.node(Add())
    assert g.forward(0) == 1
    b = g.node(Add(10))
    g.edge("add", b)
    assert g.forward(0) == 11


def test_declare_says_more_of_a_node_and_a_refusal_changes_nothing():
    g = Graph.somatize(Add() >> Same())
    g.declare("same", cached=True, salt="s")
    assert g.cached() == {"same": "s"}
    with pytest.raises(ValueError, match="'gpu7'"):
        g.declare("add", device="gpu7")
    assert g.devices() == {}
    for host in ("", 5):  # as .at() refuses it
        with pytest.raises(ValueError, match="node 'add': a host is a non-empty name"):
            g.declare("add", host=host)
    assert g.hosts() == {}
    with pytest.raises(ValueError, match="declare"):
        g.declare("add", name="other")
    with pytest.raises(KeyError):
        g.declare("nope", frozen=True)
    g.invalidate()
    assert g.forward(1) == 2


# A graph pickled by somatize as it was at a4daf89 (before Graph.somatize read each node once),
# which kept what its refusals had found in another form: Graph.somatize(Node.of(nn.Linear(2, 2))
# .named("m") >> Node.of(operator.neg).named("n")), then g.node("k", Node.of(operator.pos).cached())
# and a refused g.edge("n", "k").
OLDER = (
    "gASVuwcAAAAAAACMDnNvbWF0aXplLmdyYXBolIwFR3JhcGiUk5QpgZR9lCiMBV9pbXBslH2UKIwBbZSMDXNvbWF0aXpl"
    "Lm5vZGWUjAdXcmFwcGVklJOUKYGUfZQojA5fc29tYXRpemVfYXJnc5R9lIwEaGVsZJSMF3RvcmNoLm5uLm1vZHVsZXMu"
    "bGluZWFylIwGTGluZWFylJOUKYGUfZQojAh0cmFpbmluZ5SIjAtfcGFyYW1ldGVyc5R9lCiMBndlaWdodJSMDHRvcmNo"
    "Ll91dGlsc5SMEl9yZWJ1aWxkX3BhcmFtZXRlcpSTlGgZjBJfcmVidWlsZF90ZW5zb3JfdjKUk5QojA10b3JjaC5zdG9y"
    "YWdllIwQX2xvYWRfZnJvbV9ieXRlc5STlEILAQAAgAKKCmz8nEb5IGqoUBkugAJN6QMugAJ9cQAoWBAAAABwcm90b2Nv"
    "bF92ZXJzaW9ucQFN6QNYDQAAAGxpdHRsZV9lbmRpYW5xAohYCgAAAHR5cGVfc2l6ZXNxA31xBChYBQAAAHNob3J0cQVL"
    "AlgDAAAAaW50cQZLBFgEAAAAbG9uZ3EHSwR1dS6AAihYBwAAAHN0b3JhZ2VxAGN0b3JjaApGbG9hdFN0b3JhZ2UKcQFY"
    "DgAAADk0Njg4ODU0ODc1OTY4cQJYAwAAAGNwdXEDSwROdHEEUS6AAl1xAFgOAAAAOTQ2ODg4NTQ4NzU5NjhxAWEuBAAA"
    "AAAAAAAiea27nDbCPrH8FL8dOAW/lIWUUpRLAEsCSwKGlEsCSwGGlImMC2NvbGxlY3Rpb25zlIwLT3JkZXJlZERpY3SU"
    "k5QpUpR0lFKUiGgoKVKUh5RSlIwEYmlhc5RoG2gdKGggQgMBAACAAooKbPycRvkgaqhQGS6AAk3pAy6AAn1xAChYEAAA"
    "AHByb3RvY29sX3ZlcnNpb25xAU3pA1gNAAAAbGl0dGxlX2VuZGlhbnECiFgKAAAAdHlwZV9zaXplc3EDfXEEKFgFAAAA"
    "c2hvcnRxBUsCWAMAAABpbnRxBksEWAQAAABsb25ncQdLBHV1LoACKFgHAAAAc3RvcmFnZXEAY3RvcmNoCkZsb2F0U3Rv"
    "cmFnZQpxAVgOAAAAOTQ2ODg4NTQ5MzgxNjBxAlgDAAAAY3B1cQNLAk50cQRRLoACXXEAWA4AAAA5NDY4ODg1NDkzODE2"
    "MHEBYS4CAAAAAAAAANZwi76rKkI+lIWUUpRLAEsChZRLAYWUiWgoKVKUdJRSlIhoKClSlIeUUpR1jAhfYnVmZmVyc5R9"
    "lIwbX25vbl9wZXJzaXN0ZW50X2J1ZmZlcnNfc2V0lI+UjBNfYmFja3dhcmRfcHJlX2hvb2tzlGgoKVKUjA9fYmFja3dh"
    "cmRfaG9va3OUaCgpUpSMFl9pc19mdWxsX2JhY2t3YXJkX2hvb2uUTowOX2ZvcndhcmRfaG9va3OUaCgpUpSMGl9mb3J3"
    "YXJkX2hvb2tzX3dpdGhfa3dhcmdzlGgoKVKUjBxfZm9yd2FyZF9ob29rc19hbHdheXNfY2FsbGVklGgoKVKUjBJfZm9y"
    "d2FyZF9wcmVfaG9va3OUaCgpUpSMHl9mb3J3YXJkX3ByZV9ob29rc193aXRoX2t3YXJnc5RoKClSlIwRX3N0YXRlX2Rp"
    "Y3RfaG9va3OUaCgpUpSMFV9zdGF0ZV9kaWN0X3ByZV9ob29rc5RoKClSlIwaX2xvYWRfc3RhdGVfZGljdF9wcmVfaG9v"
    "a3OUaCgpUpSMG19sb2FkX3N0YXRlX2RpY3RfcG9zdF9ob29rc5RoKClSlIwIX21vZHVsZXOUfZSMC2luX2ZlYXR1cmVz"
    "lEsCjAxvdXRfZmVhdHVyZXOUSwJ1YnNoD2gTjAV0YWtlc5RoCIwGX1Rha2VzlJOUKYGUTn2UKIwFbmFtZWSUKIwFaW5w"
    "dXSUkZSMCHJlcXVpcmVklChoYJGUjAhhbnlfbmFtZZSJjAZwbGFjZXOUSwGMBW5lZWRzlEsBjAphbnlfbnVtYmVylIl1"
    "hpRidWKMAW6UaAopgZR9lChoDX2UaA+MCV9vcGVyYXRvcpSMA25lZ5STlHNoD2hvaFpoXCmBlE59lChoXyiRlGhiKJGU"
    "aGSJaGVLAWhmSwFoZ4l1hpRidWKMAWuUaAopgZR9lChoDX2UaA9obYwDcG9zlJOUc2gPaHpoWmhcKYGUTn2UKGhfKJGU"
    "aGIokZRoZIloZUsBaGZLAWhniXWGlGJ1YnWMCV9zZXR0aW5nc5R9lChoB2gIjAhTZXR0aW5nc5STlCmBlH2UKIwEbmFt"
    "ZZRoB4wGZGV2aWNllE6MBGhvc3SUTowGZnJvemVulE6MBmNhY2hlZJROjARzYWx0lE6MBm1hcHBlZJROdWJoaWiDKYGU"
    "fZQoaIZoaWiHTmiITmiJTmiKTmiLTmiMTnViaHVogymBlH2UKGiGaHVoh05oiE5oiU5oiohoi05ojE51YnWMBV9zdWNj"
    "lH2UKGgHXZRoaWFoaV2UaHVdlHWMBV9wcmVklH2UKGgHXZRoaV2UaAdhaHVdlHWMBl9lZGdlc5RdlGgHaGmGlGGMB19j"
    "b3VudHOUfZSMBV9wbGFulE6MCF91bmtleWVklH2UjAZfYWJvdmWUfZQoaAdoB2hpaAd1fZSGlHViLg=="
)


def test_a_graph_pickled_by_an_older_version_loads_and_builds_on():
    import base64
    import operator
    import pickle

    import torch

    from somatize.torch import parameters

    g = pickle.loads(base64.b64decode(OLDER))
    assert g.nodes() == ["m", "n", "k"] and g.edges() == [("m", "n")] and g.cached() == {"k": None}
    with pytest.raises(ValueError, match="'k' is .cached.. but is fed by node 'm'"):
        g.edge("n", "k")  # 'm' is trainable
    assert g.edges() == [("m", "n")]
    w, b = (p.detach().double() for p in parameters(g))
    for p in parameters(g):
        p.requires_grad_(False)
    g.edge("n", "k")  # read again: it no longer is
    assert g.edges() == [("m", "n"), ("n", "k")]
    x = torch.tensor([[1.0, -2.0]])
    want = operator.pos(-(x.double() @ w.T + b))
    tol = 8 * torch.finfo(torch.float32).eps  # two products and a sum, in float32
    assert torch.allclose(g.forward(x).double(), want, rtol=tol, atol=tol)


def test_a_class_given_where_one_built_is_taken_says_to_build_it_and_changes_nothing(tmp_path):
    import torch
    from models import zoo
    from transformers import BertModel

    from somatize import Recorder, Store

    model = zoo.bert(dropout=0.0).model.eval()
    g = Graph.somatize(model)
    for call in (lambda: Graph.somatize(BertModel), lambda: Node.of(BertModel)):
        with pytest.raises(TypeError, match=r"given the class BertModel: build one, BertModel\("):
            call()
    with pytest.raises(TypeError, match=r"given the class Recorder: build one, Recorder\("):
        g.forward(torch.ones(1, 4, dtype=torch.long), watching=Recorder)
    for call, where in (
        (lambda: Graph.somatize(3), "Graph.somatize takes a somatize Graph"),
        (lambda: Node.of(3), "Node.of takes a module or a function"),
        (lambda: g.forward(None, watching=[print, 3]), "watching= takes a callable"),
    ):
        with pytest.raises(TypeError, match=where + ".*, not int 3"):
            call()
    store = Store(tmp_path)  # refused before anything ran: nothing recorded
    with pytest.raises(TypeError, match="Recorder"):
        g.forward(torch.ones(1, 4, dtype=torch.long), watching=[Recorder(store), Recorder])
    assert store.bound() == []


def test_an_opaque_in_a_namedtuple_is_unwrapped_and_the_namedtuple_stays_one():
    # code written for the published package wraps what it hands on in Opaque, inside the
    # batch it builds: the node gets the bare tensor, in the same namedtuple
    import collections

    import torch
    from models import zoo

    from somatize import Opaque

    batch = collections.namedtuple("Batch", "input_ids attention_mask")
    case = zoo.bert(dropout=0.0)
    model, ids, mask = case.model.eval(), *case.example.values()
    seen = []

    def embed(b):
        seen.append(b)
        return model(input_ids=b.input_ids, attention_mask=b.attention_mask).last_hidden_state

    given = batch(Opaque(ids), mask)
    with torch.no_grad():
        out = Graph.somatize(Node.of(embed)).forward(given)
        alone = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert type(seen[0]) is batch and seen[0].input_ids is ids and seen[0].attention_mask is mask
    assert torch.equal(out, alone)
    assert type(given.input_ids) is Opaque  # the caller's batch is left as it was
    plain = batch(ids, mask)
    assert Graph.somatize(Node.of(lambda b: b).named("same")).forward(plain) is plain
