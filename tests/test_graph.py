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
