"""A Learning on a worker in a real process on 127.0.0.1 and its loads: what a Synthetic builds
lazily (its guesser) is built by a load only when that load commits, there as here; what a
Learning keeps there, and the keys a load left out, are `StateLost` when the worker restarts."""

from __future__ import annotations

import warnings

import pytest
import torch
from _remote_nodes import Lin
from test_remote import Standing, _again, _batches, _split_trainer

from somatize import Broker, Graph, Worker
from somatize.remote import StateLost, Unknown, WorkerLost
from somatize.torch import ForwardForward, Greedy, Split, Synthetic, Trainer, parameters

NODES = "_remote_nodes"
SGD = torch.optim.SGD


@pytest.fixture(scope="module")
def one():
    broker = Broker.embedded({"a": Worker.spawn(["--threads", "1"], send=[NODES])})
    yield broker
    with warnings.catch_warnings():  # what the tests' nodes learnt there is not wanted
        warnings.simplefilter("ignore", RuntimeWarning)
        broker.close()


def test_a_worker_s_synthetic_builds_its_guesser_only_when_a_load_commits(one):
    broker = one  # host "a"
    learning = Synthetic(SGD, lr=0.1)  # sent with no guesser: built there at the first output
    key = broker.key(learning)
    good = {"guesser.weight": torch.full((4, 4), 0.5), "guesser.bias": torch.full((4,), 0.25)}
    bad = {**good, "guesser.bias": torch.zeros(3)}

    def stage(lid: str, state: dict) -> None:
        message = {"op": "load", "phase": "stage", "load": lid, "key": key, "state": state}
        broker.send("a", [("mid/learning", learning, None)], message)

    def held() -> dict:
        return broker.request("a", {"op": "state", "key": key})

    with pytest.raises(ValueError, match=r"'guesser\.bias'.*shape \(3,\).*nothing was loaded"):
        stage("refused", bad)
    assert held() == {}  # the refused stage built no guesser there
    stage("dropped", good)
    broker.request("a", {"op": "load", "phase": "drop", "load": "dropped"})
    assert held() == {}  # staged and dropped (another worker failed): nothing built
    stage("taken", good)
    assert held() == {}  # staged: nothing changes before the commit
    broker.request("a", {"op": "load", "phase": "commit", "load": "taken"})
    got = held()
    assert sorted(got) == ["guesser.bias", "guesser.weight"]
    assert all(torch.equal(got[k], good[k]) for k in good)


def test_a_commit_undone_on_a_worker_leaves_its_synthetic_without_the_guesser_it_built(one):
    broker = one  # host "a": committed, then put back because another worker failed
    learning = Synthetic(SGD, lr=0.1)  # sent with no guesser: built there at the first output
    key = broker.key(learning)
    good = {"guesser.weight": torch.full((4, 4), 0.5), "guesser.bias": torch.full((4,), 0.25)}
    message = {"op": "load", "phase": "stage", "load": "undone", "key": key, "state": good}
    broker.send("a", [("mid/learning", learning, None)], message)
    broker.request("a", {"op": "load", "phase": "commit", "load": "undone"})
    assert sorted(broker.request("a", {"op": "state", "key": key})) == sorted(good)
    broker.request("a", {"op": "load", "phase": "undo", "load": "undone"})
    assert broker.request("a", {"op": "state", "key": key}) == {}  # none built, as before
    again = {**good, "guesser.bias": torch.full((4,), -1.0)}  # a later load builds it afresh
    broker.send(
        "a", [("mid/learning", learning, None)], {**message, "load": "later", "state": again}
    )
    broker.request("a", {"op": "load", "phase": "commit", "load": "later"})
    got = broker.request("a", {"op": "state", "key": key})
    assert all(torch.equal(got[k], again[k]) for k in again)


def _trainer(broker: Broker) -> Trainer:
    """on_b (frozen, on host "b") >> mid (on "a", trained by a Synthetic) >> head (here)."""
    torch.manual_seed(0)
    g = Graph.somatize(
        Lin(4, 4).named("on_b").at("b").frozen()
        >> Lin(4, 8).named("mid").at("a")
        >> Lin(8, 2).named("head")
    )
    trains = {"mid": Synthetic(SGD, lr=0.1)}
    opt = SGD(parameters(g, without=trains), lr=0.1)
    return Trainer(
        g, objective=torch.nn.functional.mse_loss, optimizer=opt, trains=trains, broker=broker
    )


def test_a_load_a_dead_worker_refuses_leaves_a_synthetic_there_and_here_as_it_was(one):
    b = Standing()  # started again by hand once the load is refused
    b.start()
    on_b = b.worker()
    on_b.connect_within = 1.0  # its loss is seen in a second
    broker = Broker.embedded({"a": one.workers["a"], "b": on_b})
    try:
        gen = torch.Generator().manual_seed(1)
        batch = (torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen))
        trained = _trainer(broker)
        trained.step(batch)  # its guesser is built on "a", at the first output
        saved = trained.export()
        assert "learning/guesser.weight" in saved["mid"]
        fresh = _trainer(broker)  # its Synthetic has not gone to "a" yet, and has no guesser
        before = {"trained": saved, "fresh": fresh.export()}
        assert not any(k.startswith("learning/") for k in before["fresh"]["mid"])
        b.stop()
        halves = {n: {k: torch.full_like(v, 0.5) for k, v in saved[n].items()} for n in saved}
        weights = {"mid": halves["mid"], "on_b": halves["on_b"]}  # "b" is met second
        for t in (trained, fresh):
            with pytest.raises(WorkerLost):
                t.load(weights)
        b.start()  # "on_b" learnt nothing there: it is sent again
        for name, t in (("trained", trained), ("fresh", fresh)):
            now, was = _again(t.export), before[name]
            assert {n: sorted(w) for n, w in now.items()} == {n: sorted(w) for n, w in was.items()}
            assert all(torch.equal(now[n][k], was[n][k]) for n in was for k in was[n])
    finally:
        b.stop()


def test_strict_counts_the_guesser_a_synthetic_built_on_its_worker(one):
    torch.manual_seed(0)
    g = Graph.somatize(Lin(4, 8).named("mid").at("a") >> Lin(8, 2).named("head"))
    trains = {"mid": Synthetic(SGD, lr=0.1)}
    opt = SGD(parameters(g, without=trains), lr=0.1)
    t = Trainer(g, objective=torch.nn.functional.mse_loss, optimizer=opt, trains=trains, broker=one)
    gen = torch.Generator().manual_seed(2)
    t.step((torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)))
    # its guesser was built on "a", at the first output; the weights below leave it out
    plain = {
        "mid": one.weights(g, "mid"),
        "head": {k: v.detach() for k, v in g.implementation("head").state_dict().items()},
    }
    with pytest.raises(ValueError, match=r"strict=True.*'mid': learning/guesser\.bias"):
        t.load(plain, strict=True)
    before = t.export()
    assert "learning/guesser.weight" in before["mid"]
    t.load(plain)  # a subset: the guesser keeps what it learnt
    now = t.export()
    assert all(torch.equal(now[n][k], before[n][k]) for n in before for k in before[n])
    t.load(before, strict=True)


LEARNINGS = {  # what each keeps on the worker, lost there when it is restarted
    "Greedy": lambda: Greedy(SGD, head=torch.nn.Linear(4, 2), lr=0.1),  # its head
    "Synthetic": lambda: Synthetic(SGD, lr=0.1),  # its guesser, built there at the first output
    "Split": lambda: Split(SGD, lr=0.1, momentum=0.9),  # its optimizer's momentum
    "ForwardForward": lambda: ForwardForward(SGD, lr=0.1, momentum=0.9),
}


def _stepped(worker: Worker, learning: str) -> tuple[Trainer, Broker, dict]:
    """mid (on host "a", trained by `learning`) >> head (here), three steps on `worker`; and
    the weights of "mid" read back after the second."""
    torch.manual_seed(0)
    g = Graph.somatize(Lin(4, 4).named("mid").at("a") >> Lin(4, 2).named("head"))
    trains = {"mid": LEARNINGS[learning]()}
    opt = SGD(parameters(g, without=trains), lr=0.1)
    mse = torch.nn.functional.mse_loss
    broker = Broker({"a": worker})
    t = Trainer(g, objective=mse, optimizer=opt, trains=trains, broker=broker)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in "abc"]
    for batch in batches[:2]:
        t.step(batch)
    read = t.export()["mid"]
    t.step(batches[2])  # "mid" and what trains it learn there past `read`
    return t, broker, read


@pytest.mark.parametrize("learning", sorted(LEARNINGS))
def test_what_a_learning_keeps_on_a_restarted_worker_is_state_lost_after_a_load_of_its_node(
    learning,
):
    w = Standing("--accept-code")  # a Greedy's head goes as code
    w.start()
    try:
        on = w.worker()
        on.connect_within = 1.0  # its loss is seen in a second
        t, broker, read = _stepped(on, learning)
        own = {k: v for k, v in read.items() if not k.startswith("learning/")}
        t.load({"mid": own})  # the node alone: what trains it learnt on there, past `read`
        w.restart()
        with pytest.raises(StateLost) as lost:  # not what it kept as it was before that step
            _again(t.export)
        assert lost.value.nodes == ["mid"]
        t.load(lost.value.exported)  # resumes from what was last read back or sent
        now = t.export()["mid"]
        assert sorted(now) == sorted(read)
        assert all(torch.equal(now[k], read[k]) for k in read)
        broker.close()  # all read back: nothing lost
    finally:
        w.stop()


def test_the_keys_a_subset_load_leaves_out_are_state_lost_on_a_restarted_worker():
    w = Standing()
    w.start()
    try:
        on = w.worker()
        on.connect_within = 1.0  # its loss is seen in a second
        t, broker, read = _stepped(on, "Synthetic")
        given = {k: v for k, v in read.items() if k != "lin.bias"}  # the guesser whole
        given["lin.weight"] = torch.full_like(read["lin.weight"], 0.5)
        t.load({"mid": given})  # a subset: lin.bias keeps what it learnt there, past `read`
        w.restart()
        with pytest.raises(StateLost) as lost:  # not lin.bias as it was before that step
            _again(t.export)
        assert lost.value.nodes == ["mid"]
        assert sorted(lost.value.exported["mid"]) == ["lin.bias", "lin.weight"]
        t.load(lost.value.exported)  # resumes from the copy here: what was given, else read
        now = t.export()["mid"]
        assert sorted(now) == sorted(read)
        assert all(torch.equal(now[k], given.get(k, read[k])) for k in read)
        broker.close()  # all read back: nothing lost
    finally:
        w.stop()


@pytest.mark.filterwarnings("ignore:closing the broker:RuntimeWarning")  # on purpose
def test_a_load_a_restarted_worker_refused_leaves_what_it_lost_state_lost():
    w = Standing()
    w.start()
    try:
        t = _split_trainer(Broker.embedded({"gpu": w.worker()}))
        data = _batches(4)
        for batch in data[:2]:
            t.step(batch)
        kept = t.export()
        t.step(data[2])  # learnt there past `kept`
        w.restart()
        with pytest.raises(Unknown):  # the broker learns of the restart from the load
            _again(lambda: t.load(kept))
        with pytest.raises(StateLost, match="'body'") as lost:  # refused: nothing changed
            t.step(data[3])
        t.load(lost.value.exported)  # resumes from the copy here, as after any restart
        resumed = lost.value.exported["body"]["lin.weight"]
        assert torch.equal(t.export()["body"]["lin.weight"], resumed)
        t.step(data[3])
    finally:
        w.stop()


def test_a_node_cast_after_it_learnt_is_read_back_and_not_behind_for_another_broker(one):
    worker = one.workers["a"]
    t = _split_trainer(Broker.embedded({"gpu": worker}))  # never closed: it stops "a"
    body = t.graph.implementation("body")
    before = body.lin.weight.detach().clone()
    data = _batches(2)
    t.step(data[0])  # learnt there
    body.double()  # read back, then built there anew; the rest stays float32: the step fails
    with pytest.raises(RuntimeError, match="dtype"):
        t.step(data[1])
    got = Broker.embedded({"gpu": worker}).weights(t.graph, "body")  # the copy here is current
    assert got["lin.weight"].dtype == torch.float64
    assert not torch.equal(got["lin.weight"], before.double())  # what it learnt there
