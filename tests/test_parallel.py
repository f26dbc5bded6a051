"""Data parallel: `Trainer(parallel=)` on two CPU ranks (gloo on 127.0.0.1), and `shard`.

The ranks are this file run as a script, once per rank, with the launcher's environment set
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), each under a hard timeout and
stopped by pid. One launch runs every scenario in one process group and writes what each
rank ended with into a directory; the tests compare it with one process on the whole batch
(float64, to 1e-6). Two more launches lose a rank (it exits, or stalls past the timeout) and
check that the other one fails with a clear error instead of waiting.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _nodes import Layer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from somatize import Graph, Node, Store
from somatize.remote import Broker, Worker
from somatize.torch import (
    ForwardForward,
    Greedy,
    RankLost,
    Split,
    Synthetic,
    Trainer,
    parameters,
    shard,
)

mse = nn.functional.mse_loss
SGD = torch.optim.SGD
N, BATCH, LR = 40, 4, 0.1  # 10 steps of 4 samples; each rank takes 2 of every 4
TOL = 1e-6
LAUNCH_S = 150  # the most one launch may take before its ranks are stopped


class Holder(Node):
    """A node holding modules as attributes (what FSDP shards module by module)."""

    def __init__(self, i: int, o: int, act: bool = True) -> None:
        self.net = nn.Sequential(nn.Linear(i, o, dtype=torch.float64), nn.Tanh())
        self.out = nn.Linear(o, o, dtype=torch.float64)
        self.act = act

    def forward(self, x, ctx):
        y = self.out(self.net(x))
        return torch.tanh(y) if self.act else y


class Branchy(Node, nn.Module):
    """Takes its `b` layer only for an input whose sum is positive."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.a = nn.Linear(4, 4, dtype=torch.float64)
        self.b = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x, ctx):
        y = torch.tanh(self.a(x))
        return torch.tanh(self.b(y)) if x.sum() > 0 else y


class Spare(Node, nn.Module):
    """A layer holding a parameter its forward never uses."""

    def __init__(self, i: int, o: int) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o, dtype=torch.float64)
        self.spare = nn.Linear(o, o, dtype=torch.float64)

    def forward(self, x, ctx):
        return torch.tanh(self.lin(x))


class Fails(Node, nn.Module):
    """A layer that, on rank 1, exits (or stalls) on its fourth forward."""

    def __init__(self, how: str) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(4, 2, dtype=torch.float64)
        self.how = how
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 4:
            if self.how == "exits":
                os._exit(17)
            time.sleep(LAUNCH_S)
        return self.lin(x)


def mlp(seed=100, kind=Layer, out=2):
    torch.manual_seed(seed)
    return Graph.somatize(
        kind(4, 8).named("a") >> kind(8, 8).named("enc") >> kind(8, out, False).named("head")
    )


def mixed(seed=100):
    """Holders around a node that is a module (whose children FSDP shards)."""
    torch.manual_seed(seed)
    return Graph.somatize(
        Holder(4, 8).named("a") >> Layer(8, 8).named("enc") >> Holder(8, 2, False).named("head")
    )


def spared(seed=100, where="enc"):
    """mlp with node `where` holding a parameter it never uses."""
    torch.manual_seed(seed)
    a = (Spare if where == "a" else Layer)(4, 8).named("a")
    enc = (Spare if where == "enc" else Layer)(8, 8).named("enc")
    return Graph.somatize(a >> enc >> Layer(8, 2, False).named("head"))


def branchy(seed=100):
    torch.manual_seed(seed)
    return Graph.somatize(Branchy().named("br") >> Layer(4, 2, False).named("head"))


def cached(seed=100):
    torch.manual_seed(seed)
    return Graph.somatize(
        Layer(4, 8).named("enc").frozen().cached() >> Layer(8, 2, False).named("head")
    )


def dataset(positive_evens=False):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, dtype=torch.float64, generator=gen)
    if positive_evens:  # rank 0's samples (the even ones) take Branchy's b, rank 1's do not
        x = x.abs() * torch.tensor([1.0, -1.0] * (N // 2), dtype=torch.float64)[:, None]
    y = torch.randn(N, 2, dtype=torch.float64, generator=gen)
    return TensorDataset(x, y)


FITS = {  # name: (graph, Trainer's keywords), each to end as one process on whole batches
    "every2": (mlp, {"every": 2}),
    "every3": (mlp, {"every": 3}),  # 10 batches: update() closes a group of 1 at the end
    "micro2": (mlp, {"micro": 2}),
    "split1": (mlp, {"split": True}),  # a node trained beside, with the Trainer's every
    "split2": (mlp, {"split": True, "every": 2}),
    "split3": (mlp, {"split": True, "every": 3}),  # and its group of 1 closed by update()
    "split_own2": (mlp, {"split": 2}),  # with an every of its own
    "split_unused": (spared, {"split": True}),  # a parameter its forward does not use
    "split_unused2": (spared, {"split": 2}),
    "greedy": (mlp, {"technique": "greedy"}),  # a node and the head it brought, averaged
    "greedy2": (mlp, {"technique": "greedy", "every": 2}),
    "fsdp1": (mixed, {"parallel": "fsdp"}),
    "fsdp2": (mixed, {"parallel": "fsdp", "every": 2}),
}


IN_STEP = {  # name: (graph, Trainer's keywords), each to end the same on every rank
    # its negatives are made within each rank's half, so it is not one process on the whole
    "ff": (mlp, {"technique": "ff"}),
}


def trainer(g, split=False, technique=None, **kw):
    trains = {"enc": Split(SGD, lr=LR, every=None if split is True else split)} if split else None
    if technique == "greedy":
        trains = {"a": Greedy(SGD, head=nn.Linear(8, 2, dtype=torch.float64), lr=LR)}
    elif technique == "synthetic":
        trains = {"enc": Synthetic(SGD, lr=LR)}
    elif technique == "ff":
        trains = {"a": ForwardForward(SGD, lr=LR)}
    opt = SGD(parameters(g, without=trains or ()), lr=LR)
    return Trainer(g, objective=mse, optimizer=opt, trains=trains, **kw)


def grad_norm(facts, where):
    """The first health fact's grad_norm at `where` (flat, as the contract has it, or under
    "numbers" as the audit said it before), or None."""
    for f in facts:
        if f.get("fact") == "health" and where in (f.get("where"), f.get("node")):
            return f.get("grad_norm", f.get("numbers", {}).get("grad_norm"))
    return None


def flat(weights):
    return {f"{n}/{k}": t.detach().contiguous() for n, s in weights.items() for k, t in s.items()}


def close(a, b, tol=TOL):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=tol, rtol=0), (k, (a[k] - b[k]).abs().max())


# -- the ranks: this file run as a script -------------------------------------------------

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def keep(out, name, weights=None, **facts):
    rank = os.environ["RANK"]
    if weights is not None:
        save_file(flat(weights), out / f"{name}.{rank}.safetensors")
    (out / f"{name}.{rank}.json").write_text(json.dumps(facts))


def mine():
    """This rank's share of every batch: 2 of each 4, through shard."""
    return DataLoader(shard(dataset()), batch_size=BATCH // 2)


@scenario
def plain(out):
    rank = int(os.environ["RANK"])
    g = mlp(seed=100 + rank)  # a different start on each rank: rank 0's is broadcast
    seen = lambda: [g.nodes(), g.edges(), g.plan_json(), g.devices(), g.hosts()]  # noqa: E731
    before = json.dumps(seen(), default=str)
    t = trainer(g, parallel="ddp")
    started = t.export()
    history = t.fit(mine()).history
    keep(out, "plain", t.export(), steps=len(history))
    keep(out, "plain_start", started, graph_kept=json.dumps(seen(), default=str) == before)


@scenario
def fits(out):
    for name, (build, kw) in {**FITS, **IN_STEP}.items():
        t = trainer(build(), **{"parallel": "ddp", **kw})
        t.fit(mine())
        keep(out, name, t.export())


@scenario
def branch(out):
    t = trainer(branchy(), parallel="ddp")
    t.fit(DataLoader(shard(dataset(positive_evens=True)), batch_size=BATCH // 2))
    keep(out, "branch", t.export())


@scenario
def weights(out):
    rank = int(os.environ["RANK"])
    t = trainer(mlp(), parallel="ddp")
    given = trainer(mlp(seed=7 + rank)).export()  # each rank has its own; rank 0's wins
    t.load(given)
    loaded = t.export()
    refused = ""
    try:  # rank 0's names a node there is not; the others pass nothing
        t.load({**given, "nowhere": {}} if rank == 0 else None)
    except ValueError as error:
        refused = str(error)
    keep(out, "weights", loaded, refused=refused)
    keep(out, "weights_after", t.export())
    sharded = trainer(mixed(), parallel="fsdp")
    sharded.load(trainer(mixed(seed=7 + rank)).export())  # cut into each rank's shards
    keep(out, "weights_fsdp", sharded.export())


@scenario
def audit(out):
    import warnings

    facts = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        t = trainer(mlp(), parallel="ddp", auditing=True, watching=facts.append)
    t.step(next(iter(mine())))
    heard = []  # across a cut, what crossed it is told as it is in one process
    trainer(mlp(), split=True, parallel="ddp", watching=heard.append).step(next(iter(mine())))
    keep(
        out,
        "audit",
        told=len(facts),
        kinds=sorted({f["fact"] for f in facts}),
        grad_norm=grad_norm(facts, "enc"),
        crossed=[f for f in heard if f["fact"] == "crossed"],
        warned=[str(w.message) for w in warned if "parallel=" in str(w.message)],
    )


@scenario
def refusals(out):
    rank = int(os.environ["RANK"])
    said = {}
    try:  # rank 1's head is wider
        trainer(mlp(out=2 + rank), parallel="ddp")
    except ValueError as error:
        said["graph"] = str(error)
    try:  # each rank its own directory
        trainer(cached(), store=out / f"store{rank}", parallel="ddp")
    except ValueError as error:
        said["store"] = str(error)
    unused = trainer(spared(where="a"), technique="greedy", parallel="ddp")
    before = unused.export()
    try:  # Greedy's own loss: averaged without DDP's walk for unused parameters
        unused.step(next(iter(mine())))
    except ValueError as error:
        said["unused"] = str(error)
    said["unmoved"] = all(
        torch.equal(before[n][k], t) for n, s in unused.export().items() for k, t in s.items()
    )
    t = trainer(cached(), store=Store(out / "store"), parallel="ddp")
    t.fit(mine())
    keep(out, "cached", t.export(), **said)


@scenario
def loses(out):
    import datetime

    import torch.distributed as dist

    how = os.environ["HOW"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))  # the timeout set
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 4).named("a") >> Fails(how).named("f"))
    t = trainer(g, parallel="ddp")
    began = time.monotonic()
    try:
        t.fit(mine())
        keep(out, how, error="")
    except RankLost as error:
        keep(out, how, error=f"{type(error).__name__}: {error}", took=time.monotonic() - began)
        sys.stdout.flush()
        os._exit(3)


class Stream(torch.utils.data.IterableDataset):
    """This rank's share of the first `n` batches, as a stream (a DataLoader of it has no
    length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        yield from list(mine())[: self.n]


@scenario
def uneven(out):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # a hang ends
    rank = int(os.environ["RANK"])
    said, steps = {}, {}
    t = trainer(mlp(), parallel="ddp")
    before = t.export()
    try:  # rank 1 has a batch less, and both have a length: refused before any step
        t.fit(list(mine())[: 5 - rank])
    except ValueError as error:
        said["sized"] = str(error)
    unmoved = all(torch.equal(before[n][k], v) for n, s in t.export().items() for k, v in s.items())
    for name, n in (("stream", 5 - rank), ("generator", 4 + rank)):  # found at the end
        data = DataLoader(Stream(n), batch_size=None)
        if name == "generator":
            data = iter(data)
        try:
            t.fit(data)
        except ValueError as error:
            said[name] = str(error)
        steps[name] = len(t.result.history)
    t.fit(DataLoader(Stream(5), batch_size=None), epochs=2)  # as many: trained in step
    steps["even"] = len(t.result.history)
    dist.barrier()  # and nothing left waiting on either rank
    keep(out, "uneven", t.export(), unmoved=unmoved, steps=steps, **said)


def _main(out: str, names: list[str]) -> None:
    for name in names:
        SCENARIOS[name](Path(out))


# -- the tests: launching the ranks -------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    out: Path, names: list[str], world: int = 2, grace: float = 20, **env: str
) -> list[tuple[int, str]]:
    """Start `world` ranks of this file on `names`; wait for rank 0 (at most LAUNCH_S) and
    then, `grace` seconds at most, for the others; stop any left by pid. Answer each rank's
    (return code, output)."""
    base = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]),
        **env,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(out), *names],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + LAUNCH_S
    answers = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            deadline = min(deadline, time.monotonic() + grace)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text = f"(stopped after {LAUNCH_S} s)\n{text}"
        answers.append((p.returncode, text))
    for p in procs:  # any left when another timed out
        if p.poll() is None:
            p.kill()
            p.wait()
    return answers


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario, once, on two ranks; what they wrote is in the directory answered."""
    out = tmp_path_factory.mktemp("ranks")
    answers = launch(out, ["plain", "fits", "branch", "weights", "audit", "refusals"])
    for code, text in answers:
        assert code == 0, text[-4000:]
    return out


def got(out, name, rank):
    return load_file(out / f"{name}.{rank}.safetensors")


def told(out, name, rank):
    return json.loads((out / f"{name}.{rank}.json").read_text())


def one_process(g, data, **kw):
    t = trainer(g, **kw)
    t.fit(DataLoader(data, batch_size=BATCH))
    return flat(t.export())


def test_two_ranks_on_half_batches_end_as_one_process_on_the_whole(ranks):
    expected = one_process(mlp(), dataset())
    start = flat(trainer(mlp()).export())
    for rank in (0, 1):
        close(got(ranks, "plain_start", rank), start)  # rank 0's weights, broadcast
        close(got(ranks, "plain", rank), expected)
        assert told(ranks, "plain", rank)["steps"] == N // BATCH
        assert told(ranks, "plain_start", rank)["graph_kept"] is True
    moved = max((expected[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e3 * TOL  # it trained: the equality above is not that of two starts


@pytest.mark.parametrize("name", list(FITS))
def test_every_micro_split_and_fsdp_end_as_one_process(ranks, name):
    build, kw = FITS[name]
    expected = one_process(build(), dataset(), **{k: v for k, v in kw.items() if k != "parallel"})
    for rank in (0, 1):
        close(got(ranks, name, rank), expected)


@pytest.mark.parametrize("name", list(IN_STEP))
def test_a_technique_on_each_rank_keeps_the_ranks_in_step(ranks, name):
    build, kw = IN_STEP[name]
    start = flat(trainer(build(), **kw).export())
    zero, one = got(ranks, name, 0), got(ranks, name, 1)
    close(zero, one, tol=0)  # the gradients were averaged: every rank took the same step
    assert max((zero[k] - start[k]).abs().max().item() for k in start) > 1e3 * TOL


def test_a_branch_one_rank_never_takes_does_not_hang_and_is_averaged(ranks):
    # By hand: each step the mean of the two halves' losses, each half taking its own branch.
    g = branchy()
    params = parameters(g)
    x, y = dataset(positive_evens=True).tensors
    for k in range(0, N, BATCH):
        loss = sum(
            mse(g.forward(x[k + r : k + BATCH : 2]), y[k + r : k + BATCH : 2]) for r in (0, 1)
        )
        for p in params:
            p.grad = None
        (loss / 2).backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    expected = flat(trainer(g).export())
    for rank in (0, 1):
        close(got(ranks, "branch", rank), expected)
    assert not torch.equal(
        expected["br/b.weight"], flat(trainer(branchy()).export())["br/b.weight"]
    )


def test_load_puts_rank_0s_weights_on_every_rank_and_a_refusal_is_everyones(ranks):
    expected = flat(trainer(mlp(seed=7)).export())
    sharded = flat(trainer(mixed(seed=7)).export())
    for rank in (0, 1):
        close(got(ranks, "weights", rank), expected, tol=0)
        close(got(ranks, "weights_after", rank), expected, tol=0)  # the refused load: nothing
        assert "'nowhere'" in told(ranks, "weights", rank)["refused"]
        close(got(ranks, "weights_fsdp", rank), sharded, tol=0)


def test_rank_0_tells_the_facts_and_the_gradient_numbers_are_averaged(ranks):
    one = told(ranks, "audit", 1)
    assert {**one, "warned": []} == {
        "told": 0,
        "kinds": [],
        "grad_norm": None,
        "crossed": [],
        "warned": [],
    }
    [said] = one["warned"]  # and rank 1 said that what it was given tells nothing there
    assert said.startswith("rank 1 of 2: the watching= and auditing= given")
    assert "rank 0 only" in said
    zero = told(ranks, "audit", 0)
    assert zero["warned"] == []
    assert {"loss", "health", "updated"} <= set(zero["kinds"])
    facts = []
    t = trainer(mlp(), auditing=True, watching=facts.append)
    t.step(next(iter(DataLoader(dataset(), batch_size=BATCH))))
    assert zero["grad_norm"] == pytest.approx(grad_norm(facts, "enc"), abs=TOL)
    heard = []
    half = next(iter(DataLoader(dataset(), batch_size=BATCH // 2)))  # a rank's share of a batch
    trainer(mlp(), split=True, watching=heard.append).step(half)
    assert zero["crossed"] == [f for f in heard if f["fact"] == "crossed"] != []


def test_ranks_that_differ_or_do_not_share_a_store_refuse_together(ranks):
    for rank in (0, 1):
        said = told(ranks, "cached", rank)
        assert "Rank(s) [1] hold another graph" in said["graph"]
        assert "'enc'" in said["store"] and "[1]" in said["store"]
    assert "node 'head'" in told(ranks, "cached", 1)["graph"]  # rank 1 says where
    for rank in (0, 1):  # a Greedy's node that leaves a parameter unused: before it moves
        said = told(ranks, "cached", rank)
        assert "node 'a'" in said["unused"] and "Greedy" in said["unused"]
        assert "['a.spare.weight', 'a.spare.bias']" in said["unused"]
        assert said["unmoved"] is True
    expected = one_process(cached(), dataset())
    for rank in (0, 1):
        close(got(ranks, "cached", rank), expected)


def test_a_rank_lost_makes_the_other_fail_clearly_within_the_timeout(tmp_path):
    def lose(how):  # rank 1 exits, or stalls past the 5 s timeout its script set
        return launch(tmp_path, ["loses"], grace=2, HOW=how)

    with ThreadPoolExecutor(2) as pool:  # the two launches at once: they mostly wait
        lost = dict(zip(["exits", "stalls"], pool.map(lose, ["exits", "stalls"]), strict=True))
    for how, ((zero, text), _) in lost.items():
        said = told(tmp_path, how, 0)
        assert zero == 3, text[-3000:]  # rank 0 stopped by itself, not by the launch's limit
        assert said["error"].startswith("RankLost: rank 0 of 2"), said
        assert "another rank stopped answering" in said["error"]
        assert said["took"] < (1 if how == "exits" else 5) + 10  # and a margin for a busy host
    assert lost["exits"][1][0] == 17  # rank 1 did exit, with its own code


def test_ranks_with_uneven_batches_are_refused_on_every_rank_not_left_waiting(tmp_path):
    for code, text in launch(tmp_path, ["uneven"], grace=30):
        assert code == 0, text[-4000:]
    for rank in (0, 1):
        said = told(tmp_path, "uneven", rank)
        assert "(rank 0 5, rank 1 4 batches)" in said["sized"]
        assert "nothing was trained" in said["sized"] and said["unmoved"] is True
        for name in ("sized", "stream", "generator"):  # each names the mode refused
            assert said[name].startswith("parallel='ddp' takes one step on every rank"), name
        assert (
            "rank(s) [1] ran out of batches after 4 while rank(s) [0] had more" in (said["stream"])
        )
        assert (
            "rank(s) [0] ran out of batches after 4 while rank(s) [1] had more"
            in (said["generator"])
        )
        assert said["steps"] == {"stream": 4, "generator": 4, "even": 10}
    close(got(tmp_path, "uneven", 0), got(tmp_path, "uneven", 1), tol=0)


# -- in this process ----------------------------------------------------------------------


def test_refused_before_any_group_is_joined(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="parallel is 'ddp'"):
        trainer(mlp(), parallel="dp")
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node=2"):
        trainer(mlp(), parallel="ddp")
    at = Graph.somatize(Layer(4, 8).named("a") >> Layer(8, 2).named("body").at("gpu"))
    broker = Broker.embedded({"gpu": Worker.at("127.0.0.1:9")})  # never reached
    for where in (None, broker):  # refused for being parallel, before a broker is asked for
        with pytest.raises(ValueError, match="node 'body' runs .at.*every rank holds"):
            trainer(at, broker=where, parallel="ddp")
    with pytest.raises(ValueError, match="node 'enc' is .cached"):
        trainer(cached(), parallel="ddp")
    with pytest.raises(ValueError, match="node 'enc' is trained by Synthetic, which moves it"):
        trainer(mlp(), technique="synthetic", parallel="ddp")
    with pytest.raises(ValueError, match="fsdp.*trains="):
        trainer(mlp(), split=True, parallel="fsdp")
    with pytest.raises(ValueError, match="audit"):
        trainer(mlp(), auditing=True, parallel="fsdp")
    g = mlp()
    before = flat(trainer(g).export())
    with pytest.raises(RuntimeError):
        trainer(g, parallel="ddp")
    close(flat(trainer(g).export()), before, tol=0)  # a refused Trainer changed nothing


def test_without_fsdp2_its_module_still_imports_and_fsdp_is_refused_naming_the_release(
    monkeypatch,
):
    """torch 2.4 and 2.5 have no `fsdp.fully_shard` and no public `DTensor` (pyproject says
    torch>=2.4): the module behind parallel='fsdp' still imports there (the docs build walks
    every module), and parallel='fsdp' is refused saying which torch has it."""
    import importlib

    import torch.distributed.fsdp
    import torch.distributed.tensor

    import somatize.torch.training as training

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard", raising=False)  # (as on 2.2)
    for name in ("DTensor", "distribute_tensor"):
        monkeypatch.delattr(torch.distributed.tensor, name, raising=False)
    monkeypatch.delitem(sys.modules, "somatize.torch.training._sharded", raising=False)
    monkeypatch.delattr(training, "_sharded", raising=False)
    importlib.import_module("somatize.torch.training._sharded")
    with pytest.raises(RuntimeError, match=r"fully_shard, which torch .* \(torch 2.6 and later"):
        trainer(mlp(), parallel="fsdp")


def test_shard_splits_like_a_distributed_sampler_and_alone_is_everything():
    items = list(range(10))
    parts = [shard(items, rank=r, world_size=3) for r in range(3)]
    assert parts == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]  # padded from the start
    assert [shard(items, rank=r, world_size=3, drop_last=True) for r in range(3)] == [
        [0, 3, 6],
        [1, 4, 7],
        [2, 5, 8],
    ]
    mixed = shard(items, rank=1, world_size=2, shuffle=True, seed=3)
    assert sorted(mixed + shard(items, rank=0, world_size=2, shuffle=True, seed=3)) == items
    assert mixed != items[1::2]
    assert shard(items) == items  # no group, no launcher: one rank of one
    sub = shard(dataset(), rank=1, world_size=2)
    assert len(sub) == N // 2 and torch.equal(sub[0][0], dataset()[1][0])
    with pytest.raises(TypeError, match="IterableDataset"):
        shard(iter(items))
    with pytest.raises(ValueError, match="rank of 0 to 1"):
        shard(items, rank=2, world_size=2)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])
