"""Nodes and the expression language: >>, |, and the declarations."""

from __future__ import annotations

import pytest
from _nodes import Add, Join, Same

from somatize import Graph, Node


def test_chain_and_branches_make_the_expected_topology():
    g = Graph.somatize(Add(1) >> (Add(2) | Add(3)) >> Join())
    assert g.nodes() == ["add", "add_2", "add_3", "join"]
    assert sorted(g.edges()) == [
        ("add", "add_2"),
        ("add", "add_3"),
        ("add_2", "join"),
        ("add_3", "join"),
    ]
    assert g.roots() == ["add"] and g.leaves() == ["join"]


def test_shift_binds_tighter_than_or():
    g = Graph.somatize(Add() >> Add() | Same())
    # (Add >> Add) | Same: two roots, two leaves
    assert g.roots() == ["add", "same"]
    assert g.leaves() == ["add_2", "same"]


def test_a_non_node_in_an_expression_is_a_type_error_naming_its_type():
    with pytest.raises(TypeError, match="int"):
        Add() >> 3
    with pytest.raises(TypeError, match="str"):
        "x" >> Add()
    with pytest.raises(TypeError, match="lambda|function"):
        Add() | (lambda x: x)


def test_constructor_arguments_are_bound_to_the_signature(store):
    class Layer(Node):
        def __init__(self, in_: int, out: int = 3) -> None:
            pass

        def forward(self, input, ctx):
            return input

    def cache(node):  # a cached node's run: a hit where one declared the same was kept
        said = []
        Graph.somatize(node.cached()).forward(1, store=store, watching=said.append)
        return [f["cache"] for f in said if f["fact"] == "ran"]

    assert cache(Layer(64, 32)) == ["miss"]
    assert cache(Layer(in_=64, out=32)) == ["hit"]  # the same declaration
    assert cache(Layer(out=32, in_=64)) == ["hit"]
    assert cache(Layer(64, out=31)) == ["miss"]  # another one
    assert cache(Layer(64)) == ["miss"]
    assert cache(Layer(64, 3)) == ["hit"]  # the default, bound as if given


def test_declarations_return_new_pieces_and_leave_the_node_alone():
    a = Add()
    on = a.on("cpu")
    assert on is not a
    g1 = Graph.somatize(a)
    assert g1.devices() == {}  # placed nowhere: not listed
    g2 = Graph.somatize(on)
    assert g2.devices() == {"add": "cpu"}


def test_innermost_wins_each_setting_independently():
    inner = Add().on("meta").named("x")
    g = Graph.somatize((inner >> Add()).on("cpu").at("h").frozen())
    assert g.devices() == {"x": "meta", "add": "cpu"}
    assert g.hosts() == {"x": "h", "add": "h"}
    assert set(g.frozen()) == {"x", "add"}


def test_cached_salt_is_handed_down_and_inner_salt_wins():
    g = Graph.somatize((Same().cached("inner") >> Same()).cached("outer"))
    assert g.cached() == {"same": "inner", "same_2": "outer"}


def test_named_refuses_a_composite_and_bad_ids():
    with pytest.raises(ValueError, match="names one node"):
        (Add() >> Add()).named("x")
    with pytest.raises(ValueError, match="id"):
        Add().named("")


def test_mapped_declared():
    g = Graph.somatize(Same() >> Same().mapped())
    assert g.mapped_nodes() == ["same_2"]


def test_a_node_must_implement_forward():
    class Empty(Node):
        pass

    with pytest.raises(TypeError):
        Empty()


# -- a module or a function as it is ------------------------------------------------------


class Keyed:
    """A callable taking keywords, as a transformers model does (no torch needed)."""

    def forward(self, input_ids, attention_mask=None):
        return ("keywords", input_ids, attention_mask)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def test_a_callable_stands_in_an_expression_as_it_is():
    def tokenize(text):
        return text.split()

    g = Graph.somatize(Node.of(tokenize) >> Node.of(len).named("count"))
    assert g.nodes() == ["tokenize", "count"]
    assert g.forward("a b c") == 3
    assert g.plan_json()["nodes"][0]["kind"] == "tokenize"
    assert Graph.somatize(lambda x: x + 1).nodes() == ["lambda"]
    node = Add()
    assert Node.of(node) is node
    assert repr(Node.of(len).named("count")) == "Node.of(len)(name='count')"
    assert repr(Add().named("plus")) == "Add(name='plus')"


def test_a_dict_whose_keys_the_forward_names_is_passed_as_keywords():
    g = Graph.somatize(Keyed())
    assert g.nodes() == ["keyed"]
    assert g.forward({"input_ids": 1, "attention_mask": 2}) == ("keywords", 1, 2)
    assert g.forward({"input_ids": 1}) == ("keywords", 1, None)
    # a dict with a key the forward does not name is the one argument, as it is
    assert g.forward({"input_ids": 1, "other": 2}) == (
        "keywords",
        {"input_ids": 1, "other": 2},
        None,
    )
    assert g.forward(5) == ("keywords", 5, None)


def test_a_forward_taking_any_name_gets_a_dict_naming_what_it_needs_as_keywords():
    def batch(**batch):  # a wrapper around a model: forward(self, **batch)
        return ("keywords", sorted(batch))

    def extra(x, **extra):
        return ("keywords", x, sorted(extra)) if extra else ("one", x)

    assert Graph.somatize(batch).forward({"x": 1, "mask": 2}) == ("keywords", ["mask", "x"])
    g = Graph.somatize(extra)
    assert g.forward({"x": 1, "mask": 2}) == ("keywords", 1, ["mask"])
    # a dict that does not name what the forward needs is its one argument, as it is
    assert g.forward({"a": 1, "b": 2}) == ("one", {"a": 1, "b": 2})
    assert g.forward({1: "a"}) == ("one", {1: "a"})


def test_a_tuple_is_the_arguments_of_a_forward_that_needs_several():
    def masked(x, mask):  # forward(self, x, mask), called as model(x, mask)
        return ("two", x, mask)

    def extra(x, mask, scale=1, *, bias=0):
        return ("args", x, mask, scale, bias)

    def one(pair, flag=False):  # needs one: a tuple is that one argument
        return ("one", pair, flag)

    def many(x, y, *rest):
        return ("many", x, y, rest)

    assert Graph.somatize(masked).forward((1, 2)) == ("two", 1, 2)
    g = Graph.somatize(extra)
    assert g.forward((1, 2)) == ("args", 1, 2, 1, 0)
    assert g.forward((1, 2, 3)) == ("args", 1, 2, 3, 0)
    assert Graph.somatize(one).forward((1, 2)) == ("one", (1, 2), False)
    assert Graph.somatize(many).forward((1, 2, 3, 4)) == ("many", 1, 2, (3, 4))
    # a list is a value (a batch of images), never spread; nor is a tuple of a length the
    # forward cannot take, which reaches it as the one argument and is refused there
    with pytest.raises(TypeError, match="mask"):
        Graph.somatize(masked).forward([1, 2])
    with pytest.raises(TypeError, match="mask"):
        Graph.somatize(masked).forward((1, 2, 3))


def test_whatever_it_returns_crosses_as_it_is():
    pair = Graph.somatize(Node.of(lambda x: (x, [x])) >> Node.of(lambda p: p))
    out = pair.forward(3)
    assert out == (3, [3]) and type(out) is tuple


def test_refusals_say_what_to_do():
    with pytest.raises(TypeError, match=r"the class Keyed: build one, Keyed\(\.\.\.\)"):
        Node.of(Keyed)
    with pytest.raises(TypeError, match="int"):
        Node.of(3)
    with pytest.raises(TypeError, match="module or a function"):
        Graph.somatize(3)

    class NoCtx(Node):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match=r"'noctx'.*does not take ctx.*Node\.of\(module\)"):
        Graph.somatize(NoCtx())
    g = Graph()
    with pytest.raises(TypeError, match="ctx"):
        g.node(NoCtx())
    assert g.nodes() == []  # refused before anything was added


def test_as_graph_is_the_one_way_a_tool_takes_a_graph_or_a_module():
    from somatize.graph import as_graph

    g = Graph.somatize(Add())
    assert as_graph(g) is g
    assert as_graph(Add() >> Add()).nodes() == ["add", "add_2"]
    assert as_graph(Keyed()).nodes() == ["keyed"]
    with pytest.raises(TypeError, match="Graph"):
        as_graph("not a graph")


def test_a_mapping_its_forward_does_not_name_goes_whole_and_a_failure_says_why():
    def embed(input_ids):
        return sum(input_ids)

    g = Graph.somatize(Node.of(embed))
    assert g.forward({"input_ids": [1, 2]}) == 3  # named: passed as keywords
    with pytest.raises(TypeError) as caught:
        g.forward({"ids": [1, 2]})  # not named: the dict is the one argument, and fails
    said = "\n".join(caught.value.__notes__)
    assert "a dict with keys ['ids'] as its one argument" in said
    assert "its forward takes (input_ids)" in said and "batch['ids']" in said
    assert "node 'embed'" in said
