"""Caching: keys from declarations and inputs, hits that skip work, refusals at build time."""

from __future__ import annotations

import pytest
import torch
from _nodes import Add, Same
from torch import nn

import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Graph, NoCodec, Node, Store


class Count(Node):
    """Multiplies by `k`; counts what it was handed."""

    def __init__(self, k: int = 2) -> None:
        self.k = k
        self.handed: list = []

    def forward(self, input, ctx):
        self.handed.append(input)
        return [v * self.k for v in input] if isinstance(input, list) else input * self.k


class Lin(Node, nn.Module):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(3, 3)

    def forward(self, input, ctx):
        return self.lin(input)


def facts_of(g, x, store):
    said = []
    out = g.forward(x, store=store, watching=said.append)
    return out, {f["node"]: f.get("cache") for f in said if f["fact"] == "ran"}


def test_second_forward_over_the_same_input_runs_no_cached_node(store):
    c = Count()
    g = Graph.somatize(Add(1) >> c.cached() >> Add(1))
    out1, said1 = facts_of(g, 3, store)
    out2, said2 = facts_of(g, 3, store)
    assert out1 == out2 == 9
    assert said1["count"] == "miss" and said2["count"] == "hit"
    assert c.handed == [4]
    facts_of(g, 4, store)  # another input misses
    assert c.handed == [4, 5]


def test_a_changed_constructor_argument_or_salt_misses(store):
    Graph.somatize(Count(2).cached()).forward(1, store=store)
    c3 = Count(3)
    assert Graph.somatize(c3.cached()).forward(1, store=store) == 3
    c2 = Count(2)
    assert Graph.somatize(c2.cached("v2")).forward(1, store=store) == 2
    assert c3.handed == [1] and c2.handed == [1]
    again = Count(2)
    Graph.somatize(again.cached()).forward(1, store=store)
    assert again.handed == []


def test_a_cached_node_after_an_uncached_one_keys_through_it(store):
    first, second = Count(2), Count(2)
    Graph.somatize(Add(1) >> first.cached()).forward(1, store=store)
    Graph.somatize(Add(5) >> second.cached()).forward(1, store=store)
    assert first.handed == [2] and second.handed == [6]


def test_tensors_are_kept_and_recalled_exactly(store):
    g = Graph.somatize(Same().cached() >> Same())
    x = torch.randn(4, 3, dtype=torch.float64)
    first = g.forward(x, store=store)
    second = g.forward(x.clone(), store=store)
    assert torch.equal(first, second) and second.dtype == torch.float64


def test_mapped_caches_item_by_item_and_hands_only_missing_items(store):
    c = Count(10)
    g = Graph.somatize(c.mapped().cached())
    assert g.forward([1, 2], store=store) == [10, 20]
    said = []
    assert g.forward([2, 3, 1], store=store, watching=said.append) == [20, 30, 10]
    assert c.handed == [[1, 2], [3]]
    assert said[0]["cache"] == "partial"
    g.forward([3, 1], store=store)
    assert c.handed == [[1, 2], [3]]


def test_a_trainable_unfrozen_cached_node_is_refused_when_built():
    with pytest.raises(ValueError, match="'lin'.*frozen"):
        Graph.somatize(Lin().cached())
    Graph.somatize(Lin().frozen().cached())  # declared frozen: fine
    Graph.somatize(Same().cached())  # stateless: fine without .frozen()


def test_frozen_state_is_part_of_the_key(store):
    a = Lin()
    x = torch.ones(1, 3)
    y1 = Graph.somatize(a.frozen().cached()).forward(x, store=store)
    with torch.no_grad():
        a.lin.bias.add_(1.0)
    y2 = Graph.somatize(a.frozen().cached()).forward(x, store=store)
    assert torch.allclose(y2, y1 + 1.0)


def test_a_value_with_no_codec_is_an_error_naming_node_type_and_codec(store):
    class Thing:
        pass

    class Make(Node):
        def forward(self, input, ctx):
            return Thing()

    with pytest.raises(NoCodec) as info:
        Graph.somatize(Make().cached()).forward(1, store=store)
    text = str(info.value)
    assert "'make'" in text and "Thing" in text and "codec(" in text


def test_a_graph_input_with_no_codec_is_noted_with_the_node_that_reads_it(store):
    class Thing:
        pass

    g = Graph.somatize(Count(2).cached())
    facts: list = []
    with pytest.raises(NoCodec, match="the graph's input") as info:
        g.forward(Thing(), store=store, watching=facts.append)
    assert info.value.__notes__ == ["while running node 'count' (Count)"]
    assert facts == [] and not [b for b in store.bound() if b.name.startswith("cache/")]


def test_a_code_change_is_warned_about_on_a_hit_at_the_users_line(store):
    Graph.somatize(Count(2).cached()).forward(7, store=store)
    for b in store.bound():
        if b.name.startswith("cache/"):
            store.bind(b.name, b.digest, meta=[("node", "count"), ("code", "older")])
    with pytest.warns(UserWarning, match="another version of its code") as told:
        Graph.somatize(Count(2).cached()).forward(7, store=store)
    assert [w.filename for w in told] == [__file__]  # the call that ran, not somatize's line


def test_store_may_be_given_as_a_path(tmp_path):
    c = Count()
    g = Graph.somatize(c.cached())
    g.forward(2, store=str(tmp_path / "s"))
    g.forward(2, store=Store(tmp_path / "s"))
    assert c.handed == [2]


def test_a_cached_mapped_node_is_checked_as_an_uncached_one_and_keeps_nothing_bad(store):
    class Short(Node):
        def forward(self, input, ctx):
            return input[:-1]

    g = Graph.somatize(Short().mapped().cached())
    with pytest.raises(ValueError, match="'short'.*handed 2 items.*as long"):
        g.forward([1, 2], store=store)
    with pytest.raises(TypeError, match="'short'.*not a list"):
        g.forward(3, store=store)
    assert not [b for b in store.bound() if b.name.startswith("cache/")]


def test_a_cached_value_the_store_lost_is_reported_naming_the_node_and_the_fix(store):
    g = Graph.somatize(Add(1) >> Count().cached())
    assert g.forward(1, store=store) == 4
    (kept,) = [b for b in store.bound() if b.name.startswith("cache/")]
    store.bind(kept.name, "sha256:" + "0" * 64)  # the name now points at bytes nobody put
    with pytest.raises(LookupError, match=r"node 'count'.*salt=") as info:
        g.forward(1, store=store)
    assert any("'count'" in note for note in info.value.__notes__)
    assert Graph.somatize(Add(1) >> Count().cached(salt="again")).forward(1, store=store) == 4
