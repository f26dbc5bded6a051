"""The engine: what crosses edges, fan-in, several leaves, errors, watching, devices."""

from __future__ import annotations

import pytest
import torch
from _nodes import Add, Join, Same

from somatize import Graph, Node, Opaque


class Boom(Node):
    def forward(self, input, ctx):
        raise KeyError("inside")


class Echo(Node):
    def forward(self, input, ctx):
        return (input, ctx.id, ctx.device)


def test_roots_get_the_input_fan_in_gets_a_dict_keyed_by_predecessor():
    join = Join()
    g = Graph.somatize(Same() >> (Add(1) >> Add(10).named("left") | Add(2).named("right")) >> join)
    assert g.forward(0) == 13
    assert join.seen == [{"left": 11, "right": 2}]


def test_several_leaves_give_a_dict_keyed_by_leaf():
    g = Graph.somatize(Same() >> (Add(1).named("a") | Add(2).named("b")))
    assert g.forward(1) == {"a": 2, "b": 3}


@pytest.mark.parametrize("value", [(1, "x"), True, 7, [1, 2], {"k": (1,)}, None])
def test_values_cross_untouched(value):
    out = Graph.somatize(Same() >> Same()).forward(value)
    assert out == value and type(out) is type(value)


def test_ints_stay_ints_and_bools_stay_bools():
    assert type(Graph.somatize(Add(1)).forward(1)) is int
    assert Graph.somatize(Same()).forward(False) is False


def test_opaque_is_unwrapped_on_arrival():
    class Wrap(Node):
        def forward(self, input, ctx):
            return Opaque([input])

    seen = []

    class Look(Node):
        def forward(self, input, ctx):
            seen.append(input)
            return input

    assert Graph.somatize(Wrap() >> Look()).forward(Opaque(3)) == [3]
    assert seen == [[3]]


def test_original_exception_type_propagates_with_a_note_naming_the_node():
    g = Graph.somatize(Same() >> Boom().named("bad") >> Same())
    with pytest.raises(KeyError) as info:
        g.forward(1)
    assert any("'bad'" in n and "Boom" in n for n in info.value.__notes__)


def test_ctx_says_id_and_device():
    assert Graph.somatize(Echo().on("cpu").named("e")).forward(5) == (5, "e", "cpu")


def test_watching_gets_typed_facts():
    facts = []
    g = Graph.somatize(Add() >> Add())
    assert g.forward(1, watching=facts.append) == 3
    ran = [f for f in facts if f["fact"] == "ran"]
    assert [f["node"] for f in ran] == ["add", "add_2"]
    assert all(isinstance(f["took_us"], float) and f["took_us"] >= 0 for f in ran)
    assert ran[1]["began_us"] >= ran[0]["began_us"]
    assert facts[-1]["fact"] == "finished" and facts[-1]["took_us"] >= ran[-1]["took_us"]


def test_watching_takes_a_list_and_refuses_what_cannot_be_called():
    a, b = [], []
    Graph.somatize(Add()).forward(1, watching=[a.append, b.append])
    assert len(a) == len(b) == 2
    with pytest.raises(TypeError, match="watching"):
        Graph.somatize(Add()).forward(1, watching=42)


def test_mapped_without_a_store_checks_lengths():
    class Bad(Node):
        def forward(self, input, ctx):
            return input[:-1]

    with pytest.raises(ValueError, match="'bad'.*as long"):
        Graph.somatize(Bad().mapped()).forward([1, 2])
    with pytest.raises(TypeError, match="not a list"):
        Graph.somatize(Same().mapped()).forward(3)


def test_a_function_standing_as_it_is_and_mapped_is_called_on_each_item():
    seen = []

    def double(v):
        seen.append(v)
        return v * 2

    assert Graph.somatize(Node.of(double).mapped()).forward([1, 2, 3]) == [2, 4, 6]
    assert seen == [1, 2, 3]
    assert Graph.somatize(Node.of(double).mapped()).forward([]) == []
    with pytest.raises(TypeError, match="'double'.*not a list"):
        Graph.somatize(Node.of(double).mapped()).forward(3)


def test_a_remote_node_without_a_broker_is_refused_naming_it():
    with pytest.raises(ValueError, match="'same'.*'gpu'.*broker"):
        Graph.somatize(Same().at("gpu")).forward(1)
    with pytest.raises(TypeError, match="Broker.embedded.*dict"):
        Graph.somatize(Same().at("gpu")).forward(1, broker={"gpu": "127.0.0.1:7000"})


class Keep(Node):
    """Keeps the ctx it was handed."""

    def forward(self, input, ctx):
        self.ctx = ctx
        return input


def test_a_graph_that_ran_goes_as_soon_as_it_is_dropped_without_waiting_for_the_collector():
    import gc
    import pickle
    import weakref

    keep = Keep()
    g = Graph.somatize(Same() >> keep)
    g.forward(1)
    assert keep.ctx.graph is g and keep.ctx.id == g.nodes()[-1]
    # a Ctx travels with its graph (as a part of a split net does, beside the graph it holds)
    copy, again = pickle.loads(pickle.dumps((g, keep.ctx)))
    assert again.id == keep.ctx.id and again.graph is copy and copy.nodes() == g.nodes()
    assert copy.forward(2) == 2  # the copy compiles a plan of its own
    gone = weakref.ref(g)
    was = gc.isenabled()
    gc.disable()
    try:
        del g, again, copy
        # the compiled plan (and each step's Ctx) points back at the graph only weakly
        assert gone() is None
        assert keep.ctx.graph is None
    finally:
        if was:
            gc.enable()


def test_an_opaque_input_is_unwrapped_inside_containers_too():
    seen = []

    class Look(Node):
        def forward(self, input, ctx):
            seen.append(input)
            return input

    g = Graph.somatize(Look())
    assert g.forward({"x": Opaque(1), "y": (Opaque(2), 3)}) == {"x": 1, "y": (2, 3)}
    assert seen == [{"x": 1, "y": (2, 3)}]


class Wraps(Node):
    """Hands its value on the published way, an Opaque inside a dict and a list."""

    def forward(self, input, ctx):
        return {"h": Opaque(input * 2), "rest": [Opaque(input), 1]}


class Reads(Node):
    """Reads what it is handed as bare values."""

    def forward(self, input, ctx):
        return input["h"] + input["rest"][0] + input["rest"][1]


def test_an_opaque_anywhere_in_a_nodes_value_is_unwrapped_on_arrival_with_or_without_a_store(
    tmp_path,
):
    from somatize import Store

    x = torch.arange(4.0)
    plain = Graph.somatize(Wraps() >> Reads())
    cached = Graph.somatize(Wraps().cached() >> Reads())
    store = Store(tmp_path)
    want = x * 3 + 1
    torch.testing.assert_close(plain(x), want)
    torch.testing.assert_close(cached.forward(x, store=store), want)  # a miss
    torch.testing.assert_close(cached.forward(x, store=store), want)  # a hit


class Deep(Node):
    """Hands on lists nested further than Python's recursion limit lets a walk of them go."""

    def forward(self, input, ctx):
        value: list = [input]
        for _ in range(5000):
            value = [value]
        return value


def test_a_value_nested_past_the_recursion_limit_crosses_an_edge_as_it_is():
    got = Graph.somatize(Deep() >> Same())(7)
    for _ in range(5001):
        assert type(got) is list and len(got) == 1
        got = got[0]
    assert got == 7


class Wrapped(Node):
    """Hands on its input inside 100,000 Opaques, one inside the next."""

    def forward(self, input, ctx):
        for _ in range(100_000):
            input = Opaque(input)
        return input


def test_a_chain_of_opaques_longer_than_the_recursion_limit_is_unwrapped_whole():
    x = torch.arange(3.0)
    assert Graph.somatize(Wrapped() >> Same())(x) is x
