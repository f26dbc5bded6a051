"""The Trainer: equivalences in float64, refusals, NoGradient, facts, export/load, caching."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
from _nodes import Layer
from torch import nn

from somatize import Graph, Node, Store
from somatize.torch import Learning, NoGradient, Result, Split, Trainer, freeze, parameters

mse = nn.functional.mse_loss
SGD = torch.optim.SGD


class Holder(Node):
    """A node that holds modules as attributes."""

    def __init__(self, i: int, o: int, act: bool = True) -> None:
        self.net = nn.Sequential(nn.Linear(i, o, dtype=torch.float64))
        self.norm = nn.BatchNorm1d(o, dtype=torch.float64, affine=False)
        self.act = act

    def forward(self, x, ctx):
        y = self.net(x)
        return torch.tanh(y) if self.act else y


def mlp(kind=Layer, seed=0):
    torch.manual_seed(seed)
    return Graph.somatize(
        kind(4, 8).named("a") >> kind(8, 8).named("enc") >> kind(8, 2, False).named("head")
    )


def batches(n=10, size=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 4, dtype=torch.float64, generator=gen),
            torch.randn(size, 2, dtype=torch.float64, generator=gen),
        )
        for _ in range(n)
    ]


def weights(g):
    return Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0)).export()


def same(w1, w2, tol=1e-12):
    assert w1.keys() == w2.keys()
    for n in w1:
        assert w1[n].keys() == w2[n].keys()
        for k in w1[n]:
            assert torch.allclose(w1[n][k], w2[n][k], atol=tol, rtol=0), (n, k)


def plain(g, **kw):
    return Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), **kw)


def split(g, **kw):
    trains = {"enc": Split(SGD, lr=0.1)}
    opt = SGD(parameters(g, without=trains), lr=0.1)
    return Trainer(g, objective=mse, optimizer=opt, trains=trains, **kw)


# -- equivalences -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Layer, Holder])
@pytest.mark.parametrize("every", [1, 2])
def test_split_on_enc_equals_plain_sgd_on_everything(kind, every):
    g1, g2 = mlp(kind), mlp(kind)
    t1, t2 = plain(g1, every=every), split(g2, every=every)
    for b in batches(10):
        assert t1.step(b) == pytest.approx(t2.step(b), abs=1e-12)
    same(t1.export(), t2.export())
    trained, fresh = t1.export()["enc"], weights(mlp(kind))["enc"]
    assert not all(trained[k].equal(fresh[k]) for k in trained)  # it did train


def test_every_k_equals_one_step_on_a_k_times_batch():
    data = batches(6)
    g1, g2 = mlp(), mlp()
    t1, t2 = plain(g1, every=3), plain(g2)
    for k in range(0, 6, 3):
        for b in data[k : k + 3]:
            t1.step(b)
        x = torch.cat([b[0] for b in data[k : k + 3]])
        y = torch.cat([b[1] for b in data[k : k + 3]])
        t2.step((x, y))
    same(t1.export(), t2.export())


@pytest.mark.parametrize("trained", [False, True])
def test_micro_k_equals_micro_1(trained):
    make = split if trained else plain
    t1, t2 = make(mlp()), make(mlp(), micro=3)
    for b in batches(5):
        assert t1.step(b) == pytest.approx(t2.step(b), abs=1e-12)
    same(t1.export(), t2.export())


@pytest.mark.parametrize("trained", [False, True])
def test_every_and_micro_multiply(trained):
    make = split if trained else plain
    t1, t2 = make(mlp(), every=2, micro=2), make(mlp())
    data = batches(4)
    for k in range(0, 4, 2):
        t1.step(data[k])
        t1.step(data[k + 1])
        t2.step((torch.cat([data[k][0], data[k + 1][0]]), torch.cat([data[k][1], data[k + 1][1]])))
    same(t1.export(), t2.export())


@pytest.mark.parametrize("trained", [False, True])
def test_update_mid_group_is_a_step_on_the_partial_sum(trained):
    g = mlp()
    t = (split if trained else plain)(g, every=4)
    data = batches(2)
    before = t.export()
    t.step(data[0])
    t.step(data[1])
    assert t.export()["enc"]["lin.weight"].equal(before["enc"]["lin.weight"])  # not yet
    assert t.update() is True
    assert t.update() is False  # nothing open any more

    # By hand: the sum of the two gradients, each of loss / every, one SGD step.
    h = mlp()
    params = parameters(h)
    for x, y in data:
        (mse(h.forward(x), y) / 4).backward()
    with torch.no_grad():
        for p in params:
            p -= 0.1 * p.grad
    same(t.export(), weights(h))


def test_training_leaves_the_graph_as_it_was():
    g = mlp()
    g2 = Graph.somatize(Layer(4, 8).named("a").on("cpu") >> Layer(8, 2).named("b"))
    for graph, make in ((g, split), (g2, plain)):
        seen = (graph.nodes(), graph.edges(), graph.plan_json(), graph.devices(), graph.hosts())
        impls = [graph.implementation(n) for n in graph.nodes()]
        make(graph).fit(
            batches(3, size=6)
            if graph is g
            else [(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64))]
        )
        assert (
            graph.nodes(),
            graph.edges(),
            graph.plan_json(),
            graph.devices(),
            graph.hosts(),
        ) == seen
        assert [graph.implementation(n) for n in graph.nodes()] == impls


def test_a_fan_in_graph_trains_the_same_with_a_split_branch():
    class Cat(Node):
        def forward(self, x, ctx):
            return torch.cat([x["l"], x["r"]], dim=1)

    def build():
        torch.manual_seed(3)
        return Graph.somatize(
            Layer(4, 4).named("src")
            >> (Layer(4, 3).named("l") | Layer(4, 3).named("r"))
            >> Cat().named("cat")
            >> Layer(6, 2, False).named("head")
        )

    g1, g2 = build(), build()
    t1 = plain(g1)
    trains = {"l": Split(SGD, lr=0.1), "cat": Split(SGD, lr=0.1)}
    with pytest.raises(ValueError, match="no parameter"):
        Split(SGD, lr=0.1).of(Cat()).optimizer  # noqa: B018
    trains = {"l": Split(SGD, lr=0.1)}
    t2 = Trainer(
        g2, objective=mse, optimizer=SGD(parameters(g2, without=trains), lr=0.1), trains=trains
    )
    for b in batches(5):
        assert t1.step(b) == pytest.approx(t2.step(b), abs=1e-12)
    same(t1.export(), t2.export())


# -- what a step says ---------------------------------------------------------------------


def test_step_returns_the_whole_loss_and_fit_a_result_that_prints_in_one_line():
    g = mlp()
    t = plain(g, every=2, micro=2)
    x, y = batches(1)[0]
    expected = mse(g.forward(x), y).item()
    assert t.step((x, y)) == pytest.approx(expected, abs=1e-12)
    result = plain(mlp()).fit(batches(4), epochs=2)
    assert isinstance(result, Result) and len(result.history) == 8
    assert result.loss == result.history[-1]
    assert Result([]).loss is None
    said = repr(result)
    first, last = result.history[0], result.history[-1]
    took = sum(result.seconds)
    assert said == f"Result(8 steps, loss {first:.3g} → {last:.3g}, {took:.3g} s)"
    assert "\n" not in said and len(result.seconds) == 8 and len(result.epochs) == 2
    assert repr(Result([])) == "Result(0 steps)" and repr(Result([0.5])).startswith(
        "Result(1 step,"
    )
    assert str(Result(list(map(float, range(1000))))).count(",") == 1  # not every loss


def test_watchers_hear_loss_updated_and_are_flushed_every_step():
    heard = []

    class Watcher:
        flushed = 0

        def __call__(self, fact):
            heard.append(fact)

        def flush(self):
            Watcher.flushed += 1

    t = plain(mlp(), every=2, watching=Watcher())
    data = batches(3)
    for b in data:
        t.step(b)
    assert t.update() is True
    kinds = [f["fact"] for f in heard if f["fact"] in ("loss", "updated")]
    assert kinds == ["loss", "loss", "updated", "loss", "updated"]
    losses = [f for f in heard if f["fact"] == "loss"]
    assert [f["step"] for f in losses] == [0, 1, 2]
    assert all(type(f["value"]) is float for f in losses)
    assert [f["step"] for f in heard if f["fact"] == "updated"] == [1, 2]
    assert sum(f["fact"] == "finished" for f in heard) == 3
    assert {f["node"] for f in heard if f["fact"] == "ran"} == {"a", "enc", "head"}
    assert Watcher.flushed == 4


def test_a_staged_forward_is_heard_as_one_forward_of_the_real_nodes():
    heard = []
    t = split(mlp(), watching=heard.append)
    t.step(batches(1)[0])
    ran = [f["node"] for f in heard if f["fact"] == "ran"]
    assert ran == ["a", "enc", "head"]
    assert [f["fact"] for f in heard].count("finished") == 1


# -- refusals -----------------------------------------------------------------------------


def refused(error, match, **kw):
    g = kw.pop("graph", None) or mlp()
    kw.setdefault("optimizer", SGD(parameters(g), lr=0.1))
    with pytest.raises(error, match=match):
        Trainer(g, objective=mse, **kw)


def test_the_constructor_refuses_with_errors_that_say_what_to_do():
    g = mlp()
    refused(ValueError, "no node of this graph", trains={"nope": Split(SGD)})
    refused(TypeError, "not a Learning", trains={"enc": SGD})
    refused(
        ValueError,
        r"parameters\(g, without=trains\)",
        graph=g,
        trains={"enc": Split(SGD)},
        optimizer=SGD(parameters(g), lr=0.1),
    )
    refused(ValueError, "none of them", optimizer=SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    refused(TypeError, "torch optimizer", optimizer="adam")
    refused(ValueError, "nothing would train", optimizer=None)
    for bad in (0, -1, 1.5, True):
        refused(ValueError, "every", every=bad)
        refused(ValueError, "micro", micro=bad)
    # a bad watching= or auditing= is a TypeError, and can still be caught as a ValueError
    for error in (TypeError, ValueError):
        refused(error, "watching", watching=42)
        refused(error, "callable", watching=[print, "no"])
        refused(error, "Audit", auditing="yes")
    same_learning = Split(SGD)
    refused(
        ValueError,
        "its own",
        trains={"a": same_learning, "enc": same_learning},
        graph=g,
        optimizer=SGD(g.implementation("head").parameters(), lr=0.1),
    )


class Free(Node):
    """A node that holds no parameters."""

    def forward(self, x, ctx):
        return x * 2


def test_a_graph_with_nothing_to_train_and_trains_naming_a_node_without_parameters_are_refused():
    g = Graph.somatize(Free().named("twice") >> Free().named("again"))
    with pytest.raises(ValueError, match="nothing to train"):
        Trainer(g, objective=mse, optimizer=SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 4).named("a").frozen() >> Free().named("twice"))
    with pytest.raises(ValueError, match="nothing to train"):
        Trainer(g, objective=mse, optimizer=SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    g = Graph.somatize(Layer(4, 4).named("a") >> Free().named("twice") >> Layer(4, 2).named("b"))
    with pytest.raises(ValueError, match="'twice'.*no parameter"):
        Trainer(
            g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), trains={"twice": Split(SGD)}
        )


def test_an_optimizer_over_a_subset_trains_that_subset_as_torch_would():
    g1, g2 = mlp(), mlp()
    held = [*g1.implementation("a").parameters(), *g1.implementation("head").parameters()]
    t = Trainer(g1, objective=mse, optimizer=SGD(held, lr=0.1))
    before = weights(g1)
    data = batches(3)
    for b in data:
        t.step(b)
    after = t.export()
    same({"enc": after["enc"]}, {"enc": before["enc"]}, tol=0)  # not held: not trained
    # by hand in plain torch: the same subset, the same steps
    opt = SGD([*g2.implementation("a").parameters(), *g2.implementation("head").parameters()], 0.1)
    for x, y in data:
        opt.zero_grad()
        mse(g2.forward(x), y).backward()
        opt.step()
    same(after, weights(g2))


def test_frozen_and_trained_is_refused_and_a_refusal_changes_nothing():
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8).named("a").frozen() >> Layer(8, 2, False).named("b"))
    learning = Split(SGD, lr=0.1)
    with pytest.raises(ValueError, match="both"):
        Trainer(
            g,
            objective=mse,
            optimizer=SGD(
                parameters(g, without=["a", "b"]) or [torch.zeros(1, requires_grad=True)], lr=0.1
            ),
            trains={"a": learning},
        )
    assert learning.node is None
    assert all(p.requires_grad for p in g.implementation("a").parameters())  # not yet settled
    with pytest.raises(ValueError, match="frozen"):
        Trainer(
            g,
            objective=mse,
            optimizer=SGD(
                list(g.implementation("a").parameters()) + list(g.implementation("b").parameters()),
                lr=0.1,
            ),
        )
    t = Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1))
    assert not any(p.requires_grad for p in g.implementation("a").parameters())
    before = g.implementation("a").lin.weight.clone()
    t.fit([(torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64))])
    assert g.implementation("a").lin.weight.equal(before)


def test_at_host_without_a_broker_or_one_it_does_not_know_is_refused_changing_nothing():
    from somatize import Broker, Worker

    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 2).named("a").at("far"))
    with pytest.raises(ValueError, match="broker"):
        Trainer(g, objective=mse, trains={"a": Split(SGD, lr=0.1)})
    learning = Split(SGD, lr=0.1)
    broker = Broker.embedded({"near": Worker.at("127.0.0.1:1")})
    with pytest.raises(ValueError, match="host 'far'.*knows \\['near'\\]"):
        Trainer(g, objective=mse, trains={"a": learning}, broker=broker)
    assert learning.node is None  # refused before it was given its node


def test_bad_batches_and_uneven_micro_pieces_are_refused():
    t = plain(mlp(), micro=4)
    with pytest.raises(TypeError, match=r"\(input, target\)"):
        t.step(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="equal pieces"):
        t.step((torch.zeros(6, 4, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.float64)))
    g = mlp()
    t = Trainer(g, objective=lambda o, y: (o - y) ** 2, optimizer=SGD(parameters(g), lr=0.1))
    with pytest.raises(TypeError, match="one number"):
        t.step(batches(1)[0])
    t = Trainer(g, objective=lambda o, y: torch.tensor(1.0), optimizer=SGD(parameters(g), lr=0.1))
    with pytest.raises(ValueError, match="does not depend"):
        t.step(batches(1)[0])
    with pytest.raises(TypeError, match="exhausted"):
        plain(mlp()).fit((b for b in batches(2)), epochs=2)


def test_with_micro_an_input_and_a_target_of_other_lengths_are_refused_before_anything_runs():
    heard = []
    g = mlp()
    # a loss that broadcasts (8, 2) against (1, 2) would give a number, and a wrong one
    t = Trainer(
        g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), micro=2, watching=heard.append
    )
    before = t.export()
    x = torch.randn(8, 4, dtype=torch.float64)
    for y in (
        torch.randn(2, 2, dtype=torch.float64),
        {"y": torch.randn(4, 2, dtype=torch.float64)},
    ):
        with pytest.raises(ValueError, match=r"target(\['y'\])? has shape \((2|4), 2\).* 8 \("):
            t.step((x, y))
    same(t.export(), before, tol=0)
    assert heard == []  # nothing ran
    assert t.update() is False


def test_a_batch_of_opaques_gives_the_step_of_the_bare_batch():
    from somatize import Opaque

    t1, t2 = plain(mlp()), plain(mlp())
    for x, y in batches(3):
        assert t1.step((Opaque(x), Opaque(y))) == t2.step((x, y))
    same(t1.export(), t2.export(), tol=0)
    assert plain(mlp()).step(Opaque(batches(1)[0])) == plain(mlp()).step(batches(1)[0])


# -- gradients like torch -------------------------------------------------------------------


class Unused(Node, nn.Module):
    """A node one of whose modules the loss never reaches (BERT's pooler under a token loss)."""

    def __init__(self):
        nn.Module.__init__(self)
        self.used = nn.Linear(4, 2, dtype=torch.float64)
        self.pooler = nn.Sequential(nn.Linear(4, 2, dtype=torch.float64))

    def forward(self, x, ctx):
        return self.used(x)


def test_a_parameter_that_got_no_gradient_is_skipped_as_torch_skips_it():
    torch.manual_seed(0)
    g = Graph.somatize(Unused().named("body"))
    t = Trainer(g, objective=mse, optimizer=torch.optim.Adam(parameters(g), lr=0.1))
    pooler = t.export()["body"]["pooler.0.weight"]
    torch.manual_seed(0)
    by_hand = Unused()
    opt = torch.optim.Adam(by_hand.parameters(), lr=0.1)  # torch's own: skips a None grad
    for x, y in batches(3):
        t.step((x, y))
        opt.zero_grad()
        mse(by_hand.used(x), y).backward()
        opt.step()
    got = t.export()["body"]
    for key, value in by_hand.state_dict().items():
        assert torch.allclose(got[key], value, atol=1e-12, rtol=0), key
    assert got["pooler.0.weight"].equal(pooler) and not got["used.weight"].equal(
        Unused().used.weight
    )


def test_no_gradient_is_a_node_none_of_whose_parameters_got_one_and_names_them():
    class Stop(Learning):
        def learn(self, signal, ctx):
            self.done()  # a cut: nothing goes back

    g = mlp()
    trains = {"enc": Stop(SGD)}
    t = Trainer(
        g, objective=mse, optimizer=SGD(parameters(g, without=trains), lr=0.1), trains=trains
    )
    before = t.export()
    for _ in range(2):  # refused again when caught: it does not train silently
        with pytest.raises(NoGradient) as caught:
            t.step(batches(1)[0])
        said = str(caught.value)
        assert "'a'" in said and "a.lin.weight" in said and "a.lin.bias" in said
        assert "'head'" not in said and "without=['a']" in said
        same(t.export(), before, tol=0)  # the optimizer did not move
    assert t.update() is False  # the refused group was dropped, not left half open


def test_once_a_node_got_a_gradient_a_step_that_leaves_it_out_trains_the_rest():
    def build():
        torch.manual_seed(0)
        return Graph.somatize(
            Layer(4, 4).named("src") >> (Layer(4, 2).named("left") | Layer(4, 2).named("right"))
        )

    steps = [0]

    def loss(out, y):  # the right branch counts only on the first step
        steps[0] += 1
        return mse(out["left"], y) + (mse(out["right"], y) if steps[0] == 1 else 0)

    g = build()
    t = Trainer(g, objective=loss, optimizer=SGD(parameters(g), lr=0.1))
    data = batches(3)
    t.step(data[0])
    right = t.export()["right"]
    for b in data[1:]:
        t.step(b)
    same({"right": t.export()["right"]}, {"right": right}, tol=0)  # skipped, not refused
    assert not t.export()["left"]["lin.weight"].equal(weights(build())["left"]["lin.weight"])


# -- export / load ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Layer, Holder])
def test_export_is_a_detached_copy_with_buffers(kind):
    g = mlp(kind)
    t = plain(g)
    out = t.export()
    assert set(out) == {"a", "enc", "head"}
    if kind is Holder:
        assert {
            "net.0.weight",
            "net.0.bias",
            "norm.running_mean",
            "norm.num_batches_tracked",
        } <= set(out["a"])
    else:
        assert set(out["a"]) == {"lin.weight", "lin.bias"}
    w = out["enc"][next(iter(out["enc"]))]
    assert not w.requires_grad
    t.fit(batches(2))
    assert not torch.equal(t.export()["enc"][next(iter(out["enc"]))], w)  # moved on, copy did not


def test_load_checks_everything_before_copying_anything():
    g = mlp()
    t = plain(g)
    good = plain(mlp(seed=5)).export()
    before = t.export()
    bad_shape = {**good, "head": {**good["head"], "lin.bias": torch.zeros(3, dtype=torch.float64)}}
    bad_key = {**good, "head": {**good["head"], "lin.nope": good["head"]["lin.bias"]}}
    bad_node = {**good, "nope": {}}
    for bad, match in ((bad_shape, "shape|holds"), (bad_key, "keys"), (bad_node, "nope")):
        with pytest.raises(ValueError, match=match):
            t.load(bad)
        same(t.export(), before, tol=0)
    t.load(good)
    same(t.export(), good, tol=0)


@pytest.mark.parametrize("kind", [Layer, Holder])
def test_load_takes_a_subset_unless_strict_which_names_every_node_and_key_left_out(kind):
    t = plain(mlp(kind))
    good = plain(mlp(kind, seed=5)).export()
    before = t.export()
    key = next(iter(good["enc"]))
    gappy = {"a": good["a"], "enc": {k: v for k, v in good["enc"].items() if k != key}}
    with pytest.raises(ValueError, match=rf"out 'enc': {re.escape(key)}; node 'head'; nothing"):
        t.load(gappy, strict=True)
    same(t.export(), before, tol=0)
    t.load(gappy)  # a subset: what is left out keeps its weights
    now = t.export()
    assert torch.equal(now["enc"][key], before["enc"][key])
    assert all(torch.equal(now["head"][k], v) for k, v in before["head"].items())
    same({"a": now["a"]}, {"a": good["a"]}, tol=0)
    t.load(good, strict=True)
    same(t.export(), good, tol=0)


# -- caching ------------------------------------------------------------------------------


def test_a_frozen_cached_encoder_runs_once_per_distinct_batch(tmp_path):
    class Counting(Layer):
        calls = 0

        def forward(self, x, ctx):
            Counting.calls += 1
            return super().forward(x, ctx)

    torch.manual_seed(0)
    g = Graph.somatize(
        Counting(4, 8).named("enc").frozen().cached() >> Layer(8, 2, False).named("head")
    )
    t = Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), store=tmp_path / "s")
    data = batches(3)
    t.fit(data, epochs=4)
    assert Counting.calls == 3
    assert isinstance(t.store, Store)


# -- progress -----------------------------------------------------------------------------


def on_a_terminal(monkeypatch, run):
    """`run()` with stderr a terminal of 100 columns: what it answers, and what it showed."""
    import fcntl
    import struct
    import sys
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        with os.fdopen(slave, "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            answer = run()
            tty.flush()
            monkeypatch.undo()
        os.set_blocking(master, False)
        read = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            read += chunk
        return answer, read.decode(errors="replace")
    finally:
        os.close(master)


def test_a_progress_bar_only_when_a_person_watches(monkeypatch, capfd):
    plain(mlp()).fit(batches(2))
    assert capfd.readouterr().err == ""  # stderr is not a terminal here: no bar
    _, shown = on_a_terminal(monkeypatch, lambda: plain(mlp()).fit(batches(2)))
    assert "training" in shown and "2/2" in shown  # a terminal on stderr: a bar


def test_a_person_watching_a_fit_over_data_without_a_length_sees_a_bar_without_a_total(
    monkeypatch,
):
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):  # no __len__: a DataLoader over it has none either
        def __iter__(self):
            return iter([(x[0], y[0]) for x, y in batches(4, size=1)])

    data = DataLoader(Stream(), batch_size=2)
    result, shown = on_a_terminal(monkeypatch, lambda: plain(mlp()).fit(data, epochs=2))
    expected = plain(mlp()).fit(list(data), epochs=2)
    assert len(result.history) == 4 and result.history == pytest.approx(expected.history)
    assert "training" in shown and "4step" in shown  # four steps counted, of no total


# -- auditing -----------------------------------------------------------------------------


def where(fact):
    """A health fact's place: `node`, or `node.inside` (the flat layout of the contract)."""
    if "where" in fact:
        return fact["where"]
    return fact["node"] + ("." + fact["inside"] if fact.get("inside") else "")


def numbers(fact):
    """A health fact's numbers."""
    return fact.get("numbers", fact)


@pytest.mark.parametrize("make", [plain, split])
def test_an_audit_is_told_after_backward_and_its_facts_reach_the_watchers(make):
    from somatize.torch import Audit

    heard = []
    g = mlp()
    t = make(g, auditing=Audit(every=1), watching=heard.append)
    for b in batches(2):
        t.step(b)
    health = [f for f in heard if f["fact"] == "health"]
    assert {where(f) for f in health} == {"a", "enc", "head"}
    assert [f["step"] for f in health if where(f) == "enc"] == [0, 1]
    enc = numbers(next(f for f in health if where(f) == "enc"))
    assert enc["grad_norm"] > 0  # the gradients were there when it looked
    order = [f["fact"] for f in heard if f["fact"] in ("loss", "health", "updated")]
    assert order.index("health") < order.index("updated")
    t.close()
    assert all("forward" not in vars(g.implementation(n)) for n in g.nodes())
    t.step(batches(1)[0])  # still trains once the hooks are off


def test_auditing_true_builds_the_default_audit():
    t = plain(mlp(), auditing=True)
    assert type(t.audit).__name__ == "Audit"
    t.close()


def test_fit_applies_a_half_open_group_at_the_end_of_each_epoch():
    heard = []
    t = plain(mlp(), every=3, watching=heard.append)
    t.fit(batches(4), epochs=2)
    assert [f["step"] for f in heard if f["fact"] == "updated"] == [2, 3, 6, 7]
    assert t.update() is False


def test_fit_walks_the_data_once_per_epoch_and_starts_no_other_walk():
    walks = []

    class Data:  # re-iterable, as a DataLoader is: each walk starts afresh (its workers, too)
        def __iter__(self):
            walks.append(1)
            return iter(batches(3))

    t = plain(mlp())
    assert len(t.fit(Data(), epochs=2).history) == 6
    assert len(walks) == 2


# -- the optimizer moves as torch's own call moves it -----------------------------------------


def test_the_optimizer_is_moved_by_its_own_calls_so_hooks_schedulers_and_profiler_hear_it():
    heard: list[str] = []
    g = mlp()
    t = plain(g)
    t.optimizer.register_step_pre_hook(lambda *a: heard.append("pre"))
    t.optimizer.register_step_post_hook(lambda *a: heard.append("post"))
    t.step(batches(1)[0])
    assert heard == ["pre", "post"]

    scheduler = torch.optim.lr_scheduler.StepLR(t.optimizer, step_size=1, gamma=0.5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        t.step(batches(1)[0])
        scheduler.step()
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        split(mlp()).step(batches(1)[0])
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#SGD.step" in names and "Optimizer.zero_grad#SGD.zero_grad" in names


def test_an_optimizer_with_its_own_zero_grad_is_asked_to_zero():
    calls: list[bool] = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    g = mlp()
    t = Trainer(g, objective=mse, optimizer=Counting(parameters(g), lr=0.1))
    t.step(batches(1)[0])
    t.step(batches(1)[0])
    assert calls == [True, True]


KERNEL_CELLS = [
    """
import torch
from torch import nn
from somatize import Graph, Node
from somatize.torch import Trainer, parameters

class Lin(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.lin = nn.Linear(4, 2)

    def forward(self, x, ctx):
        return self.lin(x)

torch.manual_seed(0)
g = Graph.somatize(Lin())
data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
t = Trainer(g, objective=nn.functional.mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
            auditing=True)
t.fit(data, epochs=2)
t.fit(data)
print(type(t.live).__name__, len(t.live.loss))
""",
    """
plain = Trainer(g, objective=nn.functional.mse_loss, optimizer=torch.optim.SGD(parameters(g)))
plain.fit(data)
print(plain.live)
""",
    """
from somatize.figures import LiveAudit

mine = LiveAudit(title="mine")
display(mine)
watched = Trainer(g, objective=nn.functional.mse_loss, auditing=True, watching=mine.run("sgd"),
                  optimizer=torch.optim.SGD(parameters(g), lr=0.1))
watched.fit(data)
print(watched.live)
""",
]


def test_in_a_notebook_a_fit_shows_its_bar_and_leaves_a_line_and_an_audited_one_its_audit(tmp_path):
    from _children import in_a_kernel

    cells = in_a_kernel(KERNEL_CELLS, tmp_path)
    outputs = cells[0].outputs
    faces = [o for o in outputs if "smz-face" in o.get("data", {}).get("text/html", "")]
    assert len(faces) == 1  # the audit shown once, and filled by both fits
    lines = [o.data["text/plain"] for o in outputs if o.get("data", {}).keys() == {"text/plain"}]
    # each bar, once its fit ended, is the line saying what the fit did (what a saved notebook keeps)
    assert len(lines) == 2 and all(
        re.fullmatch(r"training: \d+ steps, loss \S+ → \S+, [\d.]+ s", x) for x in lines
    )
    assert lines[0].startswith("training: 6 steps") and lines[1].startswith("training: 3 steps")
    assert outputs[-1]["text"].strip() == "LiveAudit 9"
    plain = cells[1].outputs  # nothing audited, nothing drawn: the bar's line, and None
    assert [o.get("data", {}).get("text/plain", "")[:17] for o in plain[:-1]] == [
        "training: 3 steps"
    ]
    assert plain[-1]["text"].strip() == "None"
    # a run of the user's own LiveAudit watching: that one is drawn, no second one beside it
    watched = cells[2].outputs
    faces = [o for o in watched if "smz-face" in o.get("data", {}).get("text/html", "")]
    assert len(faces) == 1 and "mine" in faces[0]["data"]["text/html"]
    assert watched[-1]["text"].strip() == "None"


# -- micro: what is cut, what goes to every piece whole, what is refused ---------------------


def _grads_after_one_step(g, batch, objective, micro):
    t = Trainer(g, objective=objective, optimizer=SGD(parameters(g), lr=0.0), micro=micro)
    loss = t.step(batch)
    return loss, [p.grad.clone() for p in parameters(g)]


def _same_grads(a, b, tol):
    (la, ga), (lb, gb) = a, b
    assert la == pytest.approx(lb, abs=tol)
    assert len(ga) == len(gb)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v, atol=tol, rtol=tol)


def test_micro_hands_a_none_target_flags_and_a_broadcast_tensor_to_every_piece_whole():
    # a model computing its own loss from labels, trained as the Trainer's own error advises:
    # (batch, None); use_cache=False and a (1, S) position_ids are shared by the whole batch
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=50,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(3))
    batch = {
        "input_ids": ids,
        "labels": ids,
        "use_cache": False,
        "position_ids": torch.arange(8)[None],
    }
    seen, results = [], []
    for micro in (1, 2):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double()

        def look(module, args, kw):
            seen.append(
                (kw["input_ids"].shape[0], kw["use_cache"], tuple(kw["position_ids"].shape))
            )

        model.register_forward_pre_hook(look, with_kwargs=True)
        g = Graph.somatize(model)
        results.append(_grads_after_one_step(g, (batch, None), lambda o, _: o.loss, micro))
    assert seen == [(4, False, (1, 8)), (2, False, (1, 8)), (2, False, (1, 8))]
    _same_grads(*results, tol=4 * 8 * 16 * torch.finfo(torch.float64).eps)


@pytest.mark.parametrize("words", [False, True], ids=["strings", "lists of words"])
def test_micro_cuts_a_list_of_strings_as_one_item_per_example(words):
    def encode(texts):
        rows = [["".join(s).count(c) for c in ("a", "b")] + [len(s)] for s in texts]
        return torch.tensor(rows, dtype=torch.float64)

    x = ["a b", "aa", "c d e", "banana", "", "a a a", "xyz", "ab ab"]
    x = [s.split() for s in x] if words else x
    y = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    results = []
    for micro in (1, 4):
        torch.manual_seed(0)
        g = Graph.somatize(Node.of(encode).named("encode") >> Layer(3, 2, False).named("head"))
        results.append(_grads_after_one_step(g, (x, y), mse, micro))
    _same_grads(*results, tol=8 * 3 * torch.finfo(torch.float64).eps)


def test_micro_refusals_name_the_value_its_shape_and_what_to_do_before_anything_runs():
    heard = []
    g = Graph.somatize(Node.of(lambda d: d["x"]).named("pick") >> Layer(4, 2, False).named("head"))
    t = Trainer(
        g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), micro=2, watching=heard.append
    )
    before = t.export()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    cases = [
        (
            {"x": x, "mask": torch.ones(3, 4)},
            y,
            ValueError,
            r"input\['mask'\] has shape \(3, 4\).*batch size, 4 \(the first dimension of "
            r"input\['x'\]\).*one row per example.*micro=1",
        ),
        (
            {"x": x, "names": ["a", "b", "c"]},
            y,
            ValueError,
            r"input\['names'\] is a list of 3, not the batch size, 4.*one item per example",
        ),
        ({"x": x, "extra": {1, 2}}, y, TypeError, r"input\['extra'\] is a set.*micro=1"),
        ({"x": x}, (y, torch.zeros(2)), ValueError, r"target\[1\] has shape \(2,\)"),
        (
            {"x": torch.randn(3, 4)},
            torch.randn(3, 2),
            ValueError,
            r"3 examples \(the first dimension of input\['x'\]\).*batch size that 2 divides",
        ),
        ({"x": torch.randn(1, 4)}, None, ValueError, "this one holds a single example"),
    ]
    for inp, target, kind, said in cases:
        with pytest.raises(kind, match=said):
            t.step((inp, target))
    same(t.export(), before, tol=0)
    assert heard == []  # nothing ran


@pytest.mark.parametrize(
    "make",
    [
        lambda first: nn.LSTM(3, 5, batch_first=first),
        lambda first: nn.GRU(3, 5, batch_first=first),
        lambda first: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=first),
            2,
            enable_nested_tensor=False,
        ),
    ],
    ids=["lstm", "gru", "transformer"],
)
def test_micro_refuses_a_layer_that_takes_time_first_and_cuts_a_batch_first_one_by_examples(make):
    torch.manual_seed(0)
    module = make(False).double()
    g = Graph.somatize(Node.of(module).named("seq"))
    with pytest.raises(
        ValueError,
        match=r"node 'seq' (is|holds at 'layers.0') an nn\.\w+ "
        r"built with batch_first=False.*batch_first=True",
    ):
        Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), micro=2)
    Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1))  # micro=1 cuts nothing

    gen = torch.Generator().manual_seed(5)
    width = 4 if isinstance(module, nn.TransformerEncoder) else 3
    x = torch.randn(4, 6, width, dtype=torch.float64, generator=gen)  # (batch, time, features)
    y = torch.randn(4, 6, width if width == 4 else 5, dtype=torch.float64, generator=gen)

    def objective(out, target):
        return mse(out if isinstance(out, torch.Tensor) else out[0], target)

    results = []
    for micro in (1, 2):
        torch.manual_seed(0)
        g = Graph.somatize(Node.of(make(True).double()).named("seq"))
        results.append(_grads_after_one_step(g, (x, y), objective, micro))
    _same_grads(*results, tol=4 * 6 * 8 * torch.finfo(torch.float64).eps)


def test_micro_refuses_a_time_first_lstm_held_inside_a_node_and_names_where():
    class Tagger(Node):
        def __init__(self):
            self.rnn = nn.LSTM(3, 5)
            self.head = nn.Linear(5, 2)

        def forward(self, x, ctx):
            return self.head(self.rnn(x)[0])

    g = Graph.somatize(Tagger().named("tagger"))
    with pytest.raises(ValueError, match=r"node 'tagger' holds at 'rnn' an nn\.LSTM"):
        Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), micro=2)


def test_micro_refuses_a_batchnorm_being_trained_and_takes_one_in_a_frozen_node():
    class Normed(Node):
        def __init__(self):
            f64 = torch.float64
            self.net = nn.Sequential(
                nn.Linear(4, 6, dtype=f64), nn.BatchNorm1d(6, dtype=f64), nn.Linear(6, 2, dtype=f64)
            )

        def forward(self, x, ctx):
            return self.net(x)

    def graph():
        torch.manual_seed(0)
        return Graph.somatize(Normed().named("body") >> Layer(2, 2, False).named("out"))

    g = graph()
    said = r"node 'body' holds at 'net.1' an nn\.BatchNorm1d.*micro=1"
    with pytest.raises(ValueError, match=said):
        Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), micro=2)
    # frozen, it runs in eval mode on its running statistics: each row on its own, so the
    # pieces give the gradient of the whole batch
    ((x, y),) = batches(n=1, size=8)
    results = []
    for micro in (1, 4):
        g = graph()
        freeze(g, "body")
        results.append(_grads_after_one_step(g, (x, y), mse, micro))
    _same_grads(*results, tol=8 * 16 * torch.finfo(torch.float64).eps)


class Normed(Node, nn.Module):
    """A float64 linear layer, then a BatchNorm: what it computes depends on its mode."""

    def __init__(self, i: int, o: int) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o, dtype=torch.float64)
        self.norm = nn.BatchNorm1d(o, dtype=torch.float64)

    def forward(self, x, ctx):
        return self.norm(self.lin(x))


def test_a_step_puts_the_nodes_it_trains_back_in_train_mode_after_a_validation_pass():
    torch.manual_seed(0)
    g = Graph.somatize(
        Normed(4, 4).named("stem").frozen()
        >> Normed(4, 4).named("left_out")
        >> Normed(4, 4).named("body")
        >> Layer(4, 2, False).named("head")
    )
    held = [p for n in ("body", "head") for p in g.implementation(n).parameters()]
    t = Trainer(g, objective=mse, optimizer=SGD(held, lr=0.1))
    data = batches(n=2, size=8)
    t.fit(data)
    nodes = {n: g.implementation(n) for n in g.nodes()}
    for node in nodes.values():  # a validation pass, the torch way
        node.eval()
    body = nodes["body"].norm
    before = body.running_mean.clone()
    t.fit(data)
    assert nodes["body"].training and body.training and nodes["head"].training
    assert not torch.equal(body.running_mean, before)  # batch statistics, as training takes
    assert not nodes["stem"].training and not nodes["left_out"].training  # not trained here
    # a submodule set to eval inside a node in train mode is the user's choice: kept
    body.eval()
    kept = body.running_mean.clone()
    t.step(data[0])
    assert nodes["body"].training and not body.training
    assert torch.equal(body.running_mean, kept)


def test_ctrl_c_in_a_fit_drops_the_open_group_and_keeps_the_losses_it_took():
    data = batches(n=8)

    class Stopped(list):  # Ctrl-C while the 7th batch is being read
        def __iter__(self):
            for i, batch in enumerate(data):
                if i == 6:
                    raise KeyboardInterrupt
                yield batch

    t = plain(mlp(), every=4)
    with pytest.raises(KeyboardInterrupt):
        t.fit(Stopped(data))
    assert len(t.result.history) == 6  # the losses so far, kept
    assert all(p.grad is None or not p.grad.any() for p in parameters(t.graph))
    at = t.export()
    t.fit(data)  # starts a new group: as a fresh run from the weights the stop left
    fresh = plain(mlp(seed=3), every=4)
    fresh.load(at)
    fresh.fit(data)
    same(t.export(), fresh.export())

    # a step that raises half way (in the objective of its second piece) drops its group too
    calls = []

    def failing(out, target):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return mse(out, target)

    g = mlp()
    t = Trainer(g, objective=failing, optimizer=SGD(parameters(g), lr=0.1), every=2, micro=2)
    t.step(data[0])
    with pytest.raises(KeyboardInterrupt):
        t.step(data[1])
    at = t.export()
    t.step(data[2])
    t.step(data[3])
    fresh = plain(mlp(seed=3), every=2, micro=2)
    fresh.load(at)
    fresh.step(data[2])
    fresh.step(data[3])
    same(t.export(), fresh.export())


def test_micro_refuses_a_dataloader_whose_last_batch_it_cannot_cut_before_the_first_step():
    from torch.utils.data import DataLoader, TensorDataset

    x, y = (torch.cat([b[i] for b in batches(n=12, size=6)])[:70] for i in (0, 1))
    g = mlp()
    t = Trainer(g, objective=mse, optimizer=SGD(parameters(g), lr=0.1), micro=4)
    before = t.export()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)  # 4 of 16, then one of 6
    said = r"batches of 16 examples and a last one of 6 \(70 in all\): pass drop_last=True"
    with pytest.raises(ValueError, match=said):
        t.fit(loader)
    same(t.export(), before, tol=0)  # refused before the first step
    result = t.fit(DataLoader(TensorDataset(x, y), batch_size=16, drop_last=True), epochs=2)
    assert len(result.history) == 8
    with pytest.raises(ValueError, match=r"2 examples .*drop_last=True"):
        t.step((x[:2], y[:2]))  # a batch handed to step says it as well


def test_a_step_with_grad_mode_off_says_so_and_changes_nothing():
    t = plain(mlp())
    before = t.export()
    for off in (torch.no_grad, torch.inference_mode, lambda: torch.set_grad_enabled(False)):
        with off(), pytest.raises(RuntimeError, match=r"grad mode is off.*torch.no_grad\(\)"):
            t.step(batches(1)[0])
    same(t.export(), before, tol=0)
    assert t.step(batches(1)[0]) > 0  # and out of it, it steps


def test_a_frozen_node_is_trained_again_the_way_the_refusal_says():
    g = mlp()
    freeze(g, "enc")
    t = plain(g)
    t.fit(batches(2))
    enc = g.implementation("enc")
    enc.requires_grad_(True)  # not enough: it is still declared frozen
    assert len(parameters(g)) == 4
    with pytest.raises(ValueError, match=r"g\.declare\('enc', frozen=False\).*requires_grad_"):
        Trainer(g, objective=mse, optimizer=SGD([*parameters(g), *enc.parameters()], lr=0.1))
    g.declare("enc", frozen=False)
    assert len(parameters(g)) == 6
    t = plain(g)
    before = t.export()["enc"]
    t.fit(batches(2))
    assert enc.training and not torch.equal(t.export()["enc"]["lin.weight"], before["lin.weight"])


def test_an_optimizer_whose_step_needs_a_closure_is_refused_naming_it():
    g = mlp()
    with pytest.raises(TypeError, match=r"LBFGS\.step needs a closure.*SGD, Adam"):
        Trainer(g, objective=mse, optimizer=torch.optim.LBFGS(parameters(g)))
    opt = SGD(parameters(g), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)  # wraps opt.step: still taken
    Trainer(g, objective=mse, optimizer=opt).step(batches(1)[0])


def test_gradient_clipping_as_the_docs_show_runs_once_per_update_as_a_hand_loop_does():
    from torch.nn.utils import clip_grad_norm_

    data = batches(n=6)
    g = mlp()
    opt = SGD(parameters(g), lr=0.1)
    clipped = []

    def clip(optimizer, args, kwargs):
        clipped.append(clip_grad_norm_(parameters(g), max_norm=0.05))

    opt.register_step_pre_hook(clip)
    Trainer(g, objective=mse, optimizer=opt, every=2).fit(data)
    assert len(clipped) == 3 and all(n > 0.05 for n in clipped)  # it clipped, once per update

    by_hand = mlp()
    params = parameters(by_hand)
    hand = SGD(params, lr=0.1)
    for i in range(0, 6, 2):
        hand.zero_grad()
        for x, y in data[i : i + 2]:
            (mse(by_hand.forward(x), y) / 2).backward()
        clip_grad_norm_(params, max_norm=0.05)
        hand.step()
    same(weights(g), weights(by_hand))


def test_load_refuses_tied_weights_given_two_values_and_takes_one_key_for_both():
    class Tied(Node, nn.Module):
        def __init__(self):
            nn.Module.__init__(self)
            self.emb = nn.Linear(4, 4, bias=False, dtype=torch.float64)
            self.out = nn.Linear(4, 4, bias=False, dtype=torch.float64)
            self.out.weight = self.emb.weight  # as GPT-2's lm_head is its wte

        def forward(self, x, ctx):
            return self.out(torch.tanh(self.emb(x)))

    torch.manual_seed(0)
    g = Graph.somatize(Tied().named("lm"))
    t = plain(g)
    x = torch.randn(4, 4, dtype=torch.float64)
    t.fit([(x, x)])
    before = t.export()
    assert set(before["lm"]) == {"emb.weight", "out.weight"}
    differ = {"lm": {"emb.weight": torch.zeros(4, 4), "out.weight": torch.ones(4, 4)}}
    with pytest.raises(ValueError, match=r"'emb.weight' and 'out.weight' are one tensor.*nothing"):
        t.load(differ)
    same(t.export(), before, tol=0)
    t.load({"lm": {"out.weight": torch.ones(4, 4)}})
    lm = g.implementation("lm")
    assert lm.out.weight is lm.emb.weight and torch.equal(lm.emb.weight, torch.ones(4, 4).double())


def test_a_compiled_nodes_weights_go_by_the_keys_of_the_module_it_compiled():
    from somatize.torch import named_parameters

    def graph(compiled):
        torch.manual_seed(0)
        node = Layer(4, 2, False)
        if compiled:
            node.lin = torch.compile(node.lin, backend="eager")
        return Graph.somatize(node.named("lin"))

    g = graph(True)
    t = plain(g)
    t.fit(batches(2))
    out = t.export()
    assert set(out["lin"]) == {"lin.weight", "lin.bias"}
    assert [n for n, _ in named_parameters(g)] == ["lin.lin.weight", "lin.lin.bias"]
    twin = plain(graph(False))
    twin.load(out, strict=True)  # into the eager twin, and back
    same(twin.export(), out, tol=0)
    t.load(twin.export())


_NORM = nn.LayerNorm(4)  # a module a notebook holds as a global, called by a function node


def _normed(o):
    return _NORM(o)


def test_a_function_node_calling_a_module_it_reaches_by_name_is_warned_of_when_nothing_trains_it():
    torch.manual_seed(0)
    scale = nn.Linear(4, 4)  # in the closure of the lambda
    for fn, name, module in ((lambda o: scale(o), "scale", scale), (_normed, "_NORM", _NORM)):
        g = Graph.somatize(Node.of(nn.Linear(4, 4)) >> Node.of(fn).named("post"))
        with pytest.warns(UserWarning, match=rf"node 'post' is a function that calls '{name}'"):
            Trainer(g, objective=nn.functional.mse_loss, optimizer=SGD(parameters(g), lr=0.1))
        outside = list(module.parameters())
        with warnings.catch_warnings():  # the optimizer holds them: they do train
            warnings.simplefilter("error")
            opt = SGD([*parameters(g), *outside], lr=0.1)
            t = Trainer(g, objective=nn.functional.mse_loss, optimizer=opt)
            before = [p.detach().clone() for p in outside]
            x = torch.randn(3, 4)
            t.step((x, x))
        assert all(not torch.equal(a, p) for a, p in zip(before, outside, strict=True))


def test_a_function_node_calling_a_module_of_another_node_is_not_warned_of():
    # the module is that node's: frozen it stays, trained by a Split it trains there
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    last = stem[1]
    head = nn.Linear(4, 4)
    g = Graph.somatize(
        Node.of(stem).named("stem").frozen()
        >> Node.of(lambda o: last(o) + o).named("post")
        >> Node.of(nn.Linear(4, 4)).named("mid")
        >> Node.of(head).named("head")
        >> Node.of(lambda o: head(o)).named("again")
    )
    trains = {"head": Split(SGD, lr=0.1)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = SGD(parameters(g, without=trains), lr=0.1)
        t = Trainer(g, objective=nn.functional.mse_loss, optimizer=opt, trains=trains)
    x = torch.randn(3, 4)
    kept, before = [p.detach().clone() for p in last.parameters()], head.weight.detach().clone()
    t.step((x, x))
    assert all(torch.equal(a, p) for a, p in zip(kept, last.parameters(), strict=True))
    assert not torch.equal(head.weight, before)  # trained by its Split


def test_steps_set_on_resuming_go_on_and_a_bad_one_or_an_open_group_is_refused():
    facts = []
    t = plain(mlp(), every=2, watching=facts.append)
    t.steps = 6  # a run resumed after 6 steps
    t.fit(batches(3))
    assert [f["step"] for f in facts if f["fact"] in ("loss", "updated")] == [6, 7, 7, 8, 8]
    assert t.steps == 9 and "steps=9" in repr(t)
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"t.steps is how many steps .* int >= 0"):
            t.steps = bad
    t.step(batches(1)[0])  # a group of 2 left open
    with pytest.raises(RuntimeError, match=r"group .* is open here: call t.update\(\) first"):
        t.steps = 0
    assert t.steps == 10
    t.update()
    t.steps = 0
    assert t.step(batches(1)[0]) > 0 and facts[-1] == {
        "fact": "loss",
        "value": facts[-1]["value"],
        "step": 0,
    }
