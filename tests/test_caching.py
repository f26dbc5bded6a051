"""Caching: keys from declarations and inputs, hits that skip work, refusals at build time."""

from __future__ import annotations

import os

import pytest
import torch
from _nodes import Add, Same
from torch import nn

import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Graph, NoCodec, Node, Store
from somatize.torch import freeze


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

    def run():
        g = Graph.somatize(a.frozen().cached())
        freeze(g)  # settled: eval mode, no gradients (else a warning says it is not)
        return g.forward(x, store=store)

    y1 = run()
    with torch.no_grad():
        a.lin.bias.add_(1.0)
    assert torch.allclose(run(), y1 + 1.0)


class Heads(Node):
    """Runs `enc` (a module it holds), then `heads["head"]` (one held in a dict)."""

    def __init__(self, enc: nn.Module, heads: dict) -> None:
        self.enc, self.heads = enc, heads

    def forward(self, input, ctx):
        return self.heads["head"](self.enc(input))


class Routed(nn.Module):
    """A module that holds a layer in a dict, outside its state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.extra = {"head": nn.Linear(3, 3, dtype=torch.float64)}

    def forward(self, input):
        return self.extra["head"](self.lin(input))


def test_a_module_held_in_a_dict_is_in_the_key_of_a_frozen_node(store):
    node = Heads(Routed(), {"head": nn.Linear(3, 3, dtype=torch.float64)})
    x = torch.ones(1, 3, dtype=torch.float64)
    facts_of(Graph.somatize(node.frozen().cached()), x, store)
    for layer in (node.heads["head"], node.enc.extra["head"]):  # the node's, its module's
        with torch.no_grad():
            layer.bias.add_(1.0)
        out, said = facts_of(Graph.somatize(node.frozen().cached()), x, store)
        assert said["heads"] == "miss"
        assert torch.allclose(out, node.forward(x, None), rtol=1e-12, atol=1e-12)


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


def test_a_cached_value_the_store_lost_is_warned_about_computed_again_and_kept(store):
    count = Count()
    g = Graph.somatize(Add(1) >> count.cached())
    assert g.forward(1, store=store) == 4
    (kept,) = [b for b in store.bound() if b.name.startswith("cache/")]
    store.bind(kept.name, "sha256:" + "0" * 64)  # the name now points at bytes nobody put
    with pytest.warns(RuntimeWarning, match=r"node 'count'.*no longer holds.*computed again"):
        out, said = facts_of(g, 1, store)
    assert (out, said["count"], len(count.handed)) == (4, "miss", 2)
    assert store.resolve(kept.name).digest == kept.digest  # kept anew: the store is whole
    assert facts_of(g, 1, store) == (4, {"add": None, "count": "hit"})


# -- what a key takes in ------------------------------------------------------------------


class Apply(Node):
    """Calls `fn` on its input."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def forward(self, input, ctx):
        return self.fn(input)


class Tok:
    """Something like a tokenizer: an object with no codec, its vocabulary a dict."""

    def __init__(self, vocab: dict) -> None:
        self.vocab = vocab

    def __call__(self, text: str) -> list:
        return [self.vocab.get(w, 0) for w in text.split()]


def cached_run(node, x, store):
    return facts_of(Graph.somatize(node.cached()), x, store)


def make(k):
    def add(v):
        return v + k

    return add


def test_a_function_argument_is_keyed_by_its_code_defaults_and_closure(store):
    def scale(v, by=2):
        return v * by

    def scale_3(v, by=3):
        return v * by

    assert cached_run(Apply(lambda v: v + 1), 10, store) == (11, {"apply": "miss"})
    assert cached_run(Apply(lambda v: v * 2), 10, store) == (20, {"apply": "miss"})
    assert cached_run(Apply(make(1)), 10, store) == (11, {"apply": "miss"})
    assert cached_run(Apply(make(5)), 10, store) == (15, {"apply": "miss"})
    assert cached_run(Apply(scale), 10, store) == (20, {"apply": "miss"})
    assert cached_run(Apply(scale_3), 10, store) == (30, {"apply": "miss"})
    assert cached_run(Node.of(lambda v: v - 1), 3, store)[0] == 2
    assert cached_run(Node.of(lambda v: v * 3), 3, store)[0] == 9
    # what it computes, not which object it is: another closure over the same value hits
    assert cached_run(Apply(make(5)), 10, store) == (15, {"apply": "hit"})


def test_a_function_that_indexes_with_an_ellipsis_is_keyed_not_refused(store):
    last = Apply(lambda t: t[..., -1]).cached()  # its code holds `...`: a constant like 1
    first = Apply(lambda t: t[..., 0]).cached()
    x = torch.arange(6.0).reshape(2, 3)
    out, said = facts_of(Graph.somatize(last), x, store)
    assert said == {"apply": "miss"} and out.tolist() == [2.0, 5.0]
    out, said = facts_of(Graph.somatize(first), x, store)
    assert said == {"apply": "miss"} and out.tolist() == [0.0, 3.0]
    assert facts_of(Graph.somatize(last), x, store)[1] == {"apply": "hit"}


class Words:
    """Splits text with a compiled pattern, keeping what fell after `since` (a date)."""

    def __init__(self, pattern: str, since) -> None:
        import re

        self.pattern = re.compile(pattern)
        self.since = since

    def __call__(self, text: str) -> list:
        return [str(self.since), *self.pattern.findall(text)]


def test_patterns_and_dates_are_keyed_by_what_they_are_not_refused(store):
    import datetime

    day = datetime.date(2024, 1, 1)
    long = "x" * 300
    runs = [
        (Words(r"\w+", day), ["2024-01-01", "a", "b"], "miss"),
        (Words(r"\w", day), ["2024-01-01", "a", "b"], "miss"),
        (Words(r"\w+", day + datetime.timedelta(days=1)), ["2024-01-02", "a", "b"], "miss"),
        (Words(long + "|a", day), ["2024-01-01", "a"], "miss"),
        (Words(long + "|b", day), ["2024-01-01", "b"], "miss"),  # past what its repr says
        (Words(r"\w+", datetime.date(2024, 1, 1)), ["2024-01-01", "a", "b"], "hit"),
    ]
    for words, out, said in runs:
        assert cached_run(Apply(words), "a b", store) == (out, {"apply": said})


def test_an_object_argument_is_keyed_by_its_type_and_its_state(store):
    assert cached_run(Apply(Tok({"a": 1})), "a", store) == ([1], {"apply": "miss"})
    assert cached_run(Apply(Tok({"a": 7})), "a", store) == ([7], {"apply": "miss"})
    assert cached_run(Apply(Tok({"a": 7}).__call__), "a", store)[0] == [7]
    assert cached_run(Apply(Tok({"a": 7})), "a", store) == ([7], {"apply": "hit"})


class Scale:
    """Multiplies by `by`, kept in its one slot, named by a bare string as Python allows."""

    __slots__ = "by"

    def __init__(self, by: int) -> None:
        self.by = by

    def __call__(self, v):
        return v * self.by


class Shift:
    """Adds `by`, kept in a private slot (Python keeps it as `_Shift__by`)."""

    __slots__ = ("__by",)

    def __init__(self, by: int) -> None:
        self.__by = by

    def __call__(self, v):
        return v + self.__by


def test_a_defaultdicts_default_is_in_the_key(store):
    from collections import defaultdict

    for unknown, said in ((0, "miss"), (9, "miss"), (9, "hit")):
        vocab = defaultdict(lambda unknown=unknown: unknown, {"a": 1})
        assert cached_run(Apply(vocab.__getitem__), "b", store) == (unknown, {"apply": said})


def test_an_ordered_dicts_order_is_in_the_key_as_in_its_equality(store):
    from collections import OrderedDict

    for order, said in (("ab", "miss"), ("ba", "miss"), ("ba", "hit")):
        layers = OrderedDict((name, 1) for name in order)
        assert cached_run(Apply(lambda v, layers=layers: [v, *layers]), 0, store) == (
            [0, *order],
            {"apply": said},
        )
    assert cached_run(Apply(lambda v, d={"a": 1, "b": 2}: v), 0, store)[1] == {"apply": "miss"}
    assert cached_run(Apply(lambda v, d={"b": 2, "a": 1}: v), 0, store)[1] == {"apply": "hit"}


def test_an_object_whose_slots_are_one_string_or_private_is_keyed_by_what_they_hold(store):
    assert cached_run(Apply(Scale(2)), 10, store) == (20, {"apply": "miss"})
    assert cached_run(Apply(Scale(3)), 10, store) == (30, {"apply": "miss"})
    assert cached_run(Apply(Scale(3)), 10, store) == (30, {"apply": "hit"})
    assert cached_run(Apply(Shift(1)), 10, store) == (11, {"apply": "miss"})
    assert cached_run(Apply(Shift(2)), 10, store) == (12, {"apply": "miss"})


def test_a_wrapped_function_is_keyed_by_the_function_it_wraps(store, monkeypatch):
    import functools
    import sys
    import types

    held = types.ModuleType("held_by_name")  # its module holds it by name, as a library would
    monkeypatch.setitem(sys.modules, "held_by_name", held)
    for by, said in ((2, "miss"), (3, "miss"), (3, "hit")):
        exec(f"def scale(v):\n    return v * {by}\n", held.__dict__)
        held.scale = functools.lru_cache(held.scale)
        assert cached_run(Apply(held.scale), 10, store) == (10 * by, {"apply": said})


def test_an_argument_no_key_can_read_is_refused_when_built_unless_salted(store):
    import threading

    class Guarded:
        """Hands its input on, holding a lock: state nowhere Python can read it."""

        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __call__(self, v):
            return v

    lock = Guarded()
    with pytest.raises(ValueError, match=r"node 'apply' .*argument 'fn.lock'.*salt=") as info:
        Graph.somatize(Apply(lock).cached())
    assert "_thread.lock" in str(info.value)
    with pytest.raises(ValueError, match=r"node 'count' .*'fn.lock' of node 'apply'"):
        Graph.somatize(Apply(lock) >> Count().cached())  # fed by it, at any depth
    with pytest.raises(ValueError, match=r"node 'count' .*of node 'apply'"):
        Graph.somatize(Apply(lock) >> Add() >> Count().cached())
    g = Graph.somatize(Apply(lock) >> Add())
    with pytest.raises(ValueError, match=r"node 'add'.*of node 'apply'"):
        g.declare("add", cached=True)
    assert g.cached() == {}  # the refusal left it as it was
    ok = Graph.somatize(Node.of(lambda v: v) >> Apply(lock) >> Count().cached(salt="lock v1"))
    assert ok.forward(2, store=store) == 4
    Graph.somatize(Apply(lock) >> Count())  # nothing cached: nothing to refuse
    with pytest.raises(ValueError, match=r"node 'count' .*salt.*_thread.lock.*plain values"):
        Graph.somatize(Count().cached(salt=lock))  # nor can a salt be what no key reads


def test_a_module_level_functions_key_is_the_same_in_another_process(tmp_path):
    import subprocess
    import sys
    import textwrap

    (tmp_path / "keyed.py").write_text(
        textwrap.dedent(
            """
            import sys
            from somatize import Graph, Node

            def double(v, by={"k": 2, "j": [1, 2]}):
                return v * by["k"]

            class Apply(Node):
                def __init__(self, fn):
                    self.fn = fn

                def forward(self, input, ctx):
                    return self.fn(input)

            said = []
            g = Graph.somatize(Apply(double).cached())
            out = g.forward(21, store=sys.argv[1], watching=said.append)
            print(out, [f.get("cache") for f in said if f["fact"] == "ran"])
            """
        )
    )
    answers = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        ran = subprocess.run(
            [sys.executable, str(tmp_path / "keyed.py"), str(tmp_path / "store")],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        answers.append(ran.stdout.strip())
    assert answers == ["42 ['miss']", "42 ['hit']"]


# -- what a key cannot see ----------------------------------------------------------------


def test_a_cached_node_fed_by_a_trainable_unfrozen_one_is_refused_when_built():
    with pytest.raises(ValueError, match=r"node 'same' .*node 'lin'.*frozen\(\)"):
        Graph.somatize(Lin() >> Same().cached())
    with pytest.raises(ValueError, match=r"node 'count' .*node 'lin'"):
        Graph.somatize(Lin() >> (Same() | Add()) >> Count().cached())
    g = Graph()
    g.node("lin", Lin())
    g.node("same", Same())
    g.node("count", Count().cached())
    g.edge("same", "count")
    with pytest.raises(ValueError, match=r"node 'count' .*node 'lin'"):
        g.edge("lin", "same")
    assert g.edges() == [("same", "count")]  # the refused edge was not added
    Graph.somatize(Lin().frozen() >> Same().cached())  # frozen before it: fine
    Graph.somatize((Lin() >> Same()).frozen() >> Count().cached())
    Graph.somatize(Lin() | Same().cached())  # beside it, not fed by it: fine
    frozen = Graph.somatize(Lin().frozen() >> Same().cached())
    with pytest.raises(ValueError, match=r"node 'same' .*node 'lin'"):
        frozen.declare("lin", frozen=False)
    assert frozen.frozen() == {"lin": None}


def test_which_nodes_are_trainable_is_read_at_each_edge_not_once_per_graph(store):
    lin = Lin()
    lin.requires_grad_(False)  # weights set aside: caching below it is allowed
    g = Graph()
    g.node("lin", lin)
    g.node("first", Count().cached())
    g.node("second", Count(3).cached())
    g.edge("lin", "first")
    lin.requires_grad_(True)  # to fine-tune it after all
    with pytest.raises(ValueError, match=r"node 'second' .*node 'lin'.*frozen\(\)"):
        g.edge("lin", "second")  # as a graph built now refuses it
    with pytest.raises(ValueError, match=r"node 'count' .*node 'lin'"):
        Graph.somatize(lin >> Count(3).cached())
    assert g.edges() == [("lin", "first")]
    lin.requires_grad_(False)  # set aside again: accepted, as a graph built now accepts it
    g.edge("lin", "second")
    Graph.somatize(lin >> Count(3).cached())
    x = torch.ones(2, 3)
    out = g.forward(x, store=store)
    torch.testing.assert_close(out["second"], lin.lin(x) * 3)  # float32 tolerances


def test_a_trainer_load_reaches_the_key_of_a_frozen_cached_node(store):
    from torch.nn.functional import mse_loss

    from somatize.torch import Trainer, parameters

    torch.manual_seed(0)
    g = Graph.somatize(Lin().frozen().cached() >> Lin().named("head"))
    t = Trainer(g, objective=mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    x = torch.randn(4, 3)
    g.forward(x, store=store)  # keeps lin(x) for these weights
    new = {k: torch.full_like(v, 0.5) for k, v in t.export()["lin"].items()}
    t.load({"lin": new})
    said = []
    with torch.no_grad():
        cached, fresh = g.forward(x, store=store, watching=said.append), g.forward(x)
    assert {f["node"]: f.get("cache") for f in said if f["fact"] == "ran"}["lin"] == "miss"
    assert torch.equal(cached, fresh)
    with torch.no_grad():  # changed by hand: g.invalidate() says so
        g.implementation("lin").lin.bias.add_(1.0)
    g.invalidate()
    _, said = facts_of(g, x, store)
    assert said["lin"] == "miss"
