"""Data parallel: the same graph on every rank, its gradients averaged by torch's own
`DistributedDataParallel`, or its nodes' modules sharded by FSDP2's `fully_shard`.

`Trainer(g, ..., parallel="ddp")`, in a script torchrun starts once per rank: each rank holds
the whole graph, starts from rank 0's weights and steps on its own data. DDP is put around a
`_Replica`, a module holding the nodes' modules whose forward runs them as the Trainer does:
one around the whole forward, or one per part of a cut (each part's backward is an autograd
pass of its own). Inside a group every piece but the last runs under `no_sync`; a group that
`update()` closes early is averaged with one all-reduce per dtype.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from somatize import run
from somatize.torch.placement import modules_of, place, trainable
from somatize.torch.training import _ranks, _weights
from somatize.torch.training._ranks import RankLost
from somatize.torch.training.params import named, state_of

__all__ = ["MODES", "Parallel", "RankLost", "parallel_of"]

MODES = ("ddp", "fsdp")
"""What `Trainer(parallel=)` takes (besides None)."""

_CUDA_N = re.compile(r"^cuda:(\d+)$")


class _Replica(nn.Module):
    """What DDP (or FSDP) is put around: some nodes' modules, what a Learning brought besides,
    and `run`, which runs those nodes as they always run."""

    def __init__(self, modules: list[nn.Module], extra: list[nn.Parameter], run: Callable) -> None:
        super().__init__()
        self.held = nn.ModuleList(modules)
        if extra:
            self.extra = nn.ParameterList(extra)
        self.run = run

    def forward(self, *args: Any, **kw: Any) -> Any:
        """`run`, called by DDP's (or FSDP's) own forward."""
        return self.run(*args, **kw)


def parallel_of(
    mode: Any,
    graph: Any,
    *,
    trains: dict[str, Any],
    optimizer: Any,
    store: Any,
    audit: Any,
    every: int,
    micro: int,
) -> Parallel | None:
    """`Trainer(parallel=)` checked, the group joined, and every rank found to train the same;
    what is refused before anything changes is listed in docs/parallel.md."""
    if mode is None:
        return None
    if mode not in MODES:
        raise ValueError(
            f"Trainer(parallel={mode!r}): parallel is 'ddp' (every rank holds the whole graph "
            "and DDP averages the gradients), 'fsdp' (the nodes' modules sharded across the "
            "ranks by FSDP2), or None to train in this process"
        )
    for nid, host in graph.hosts().items():
        if host:
            raise ValueError(
                f"node {nid!r} runs .at({host!r}), and parallel={mode!r} trains a graph that "
                "every rank holds whole: a node on a worker would be trained by every rank at "
                "once. Drop .at() for the parallel run, or train without parallel="
            )
    cached = [nid for nid in graph.nodes() if graph.setting(nid).cached]
    if cached and store is None:
        raise ValueError(
            f"node {cached[0]!r} is .cached(), and under parallel= what it keeps has to be in "
            "one store that every rank sees: pass store= a directory all the ranks share (or "
            "an s3:// URL), or drop .cached()"
        )
    for nid, learning in trains.items():
        if learning.moves_at_forward:
            raise ValueError(
                f"node {nid!r} is trained by {type(learning).__name__}, which moves it while the "
                f"forward runs, and parallel={mode!r} averages gradients in the step's backward "
                f"only: train {nid!r} by Split, Greedy or ForwardForward under parallel=, or "
                "train without parallel="
            )
    if mode == "fsdp":
        _fsdp_refusals(trains, optimizer, audit)
    devices = {nid: d for nid, d in graph.devices().items() if d}
    cuda = any(d.startswith("cuda") for d in devices.values())
    local = os.environ.get("LOCAL_RANK")
    for nid, d in devices.items():
        n = _CUDA_N.match(d)
        if n and local is not None and int(n.group(1)) != int(local):
            raise ValueError(
                f"node {nid!r} is placed .on({d!r}), and this rank's GPU is cuda:{local} "
                "(LOCAL_RANK): place it .on('cuda'), which under parallel= is each rank's own"
            )
    _ranks.join(cuda)
    with _ranks.answering("checking that every rank trains the same graph"):
        _same_everywhere(graph, mode, trains, every, micro)
        if cached:
            _shared(store, cached[0])
    return Parallel(mode, cuda)


def _fsdp_refusals(trains: dict[str, Any], optimizer: Any, audit: Any) -> None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        raise RuntimeError(
            f"parallel='fsdp' shards with FSDP2's fully_shard, which torch {torch.__version__} "
            "does not have (torch 2.6 and later do): use parallel='ddp', or a newer torch"
        ) from None
    if trains:
        raise ValueError(
            f"parallel='fsdp' shards the modules the Trainer's optimizer moves, and trains= "
            f"puts a trainer of its own beside {sorted(trains)}: train those with "
            "parallel='ddp', or without trains="
        )
    if audit is not None:
        raise ValueError(
            "parallel='fsdp' leaves each rank a shard of every weight, and the audit reads "
            "whole weights: audit with parallel='ddp' (or without parallel=)"
        )
    if optimizer is not None and optimizer.state:
        raise ValueError(
            "parallel='fsdp' puts sharded parameters in the optimizer's place, and this one "
            "already holds state for the old ones: build a fresh optimizer over parameters(g)"
        )


def _same_everywhere(graph: Any, mode: str, trains: dict, every: int, micro: int) -> None:
    nodes = _weights.manifest({nid: state_of(graph.implementation(nid)) for nid in graph.nodes()})
    mine = dict(parallel=mode, every=every, micro=micro, trains=sorted(trains), nodes=nodes)
    theirs = _ranks.from_rank0(mine if dist.get_rank() == 0 else None)
    fields = [k for k in mine if k != "nodes" and theirs[k] != mine[k]]
    differs = _weights.difference(nodes, theirs["nodes"])
    if fields:
        differs = f"{fields[0]}={mine[fields[0]]!r} here, {theirs[fields[0]]!r} on rank 0"
    elif differs is None and list(nodes.items()) != list(theirs["nodes"].items()):
        differs = "it holds the nodes and weights rank 0 holds, in another order"
    odd = _ranks.refusing(differs is None)
    if odd:
        here = f"rank {dist.get_rank()} differs from rank 0: {differs}. " if differs else ""
        raise ValueError(
            f"{here}Rank(s) {odd} hold another graph or Trainer than rank 0, and data "
            "parallel needs the same on every rank: build them from the same code and seed "
            "(each rank differs only in its data)"
        )


def _shared(store: Any, node: str) -> None:
    """Refuses a store some rank cannot see what rank 0 keeps in (by a blob of rank 0's that
    every rank reads, then removed)."""
    said = None
    if dist.get_rank() == 0:
        token = f"somatize: rank 0's store, seen by every rank ({uuid.uuid4()})"
        try:
            said = {"key": store.put(token.encode()), "token": token}
        except (OSError, ValueError) as error:
            said = {"error": f"{type(error).__name__}: {error}"}
    said = _ranks.from_rank0(said)
    if "error" in said:
        raise ValueError(
            f"node {node!r} is .cached(), and rank 0 cannot write to {store!r}: {said['error']}"
        )
    try:
        seen = store.get(said["key"]) == said["token"].encode()
    except (OSError, ValueError):
        seen = False
    odd = _ranks.refusing(seen)  # every rank has looked: rank 0 removes what it put
    if dist.get_rank() == 0:
        try:
            store._drop(said["key"])
        except OSError:  # a bucket that takes puts and no deletes keeps it
            pass
    if odd:
        raise ValueError(
            f"node {node!r} is .cached(), and rank(s) {odd} do not see what rank 0 keeps in "
            f"{store!r}: under parallel= every rank has to share one store (a directory they "
            "all see, or an s3:// URL); pass one, or drop .cached()"
        )


class Parallel:
    """A Trainer's stages, data-parallel: what the Trainer runs in their place, a failed
    collective raised as `RankLost`. `sync`, set by the Trainer before each piece, says whether
    it closes a group (its gradients all-reduced; if not, DDP's `no_sync`, FSDP's sync off)."""

    def __init__(self, mode: str, cuda: bool) -> None:
        self.mode = mode
        self.rank = dist.get_rank()
        self.cuda = cuda
        self._stages: Any = None
        self._whole: Any = None  # the replica of a graph without a cut
        self._of: dict[int, Any] = {}  # id(part) -> its replica
        self._open: set[int] = set()  # replicas whose group is open and not averaged yet
        self._unwatched: dict[int, Callable] = {}  # id(part) -> its check, until hooked
        self.sync = True
        self._parts = SimpleNamespace(forward=self._part_forward, backward=self._part_backward)

    def __repr__(self) -> str:
        return f"Parallel({self.mode!r}, rank {self.rank} of {dist.get_world_size()})"

    # -- made once ------------------------------------------------------------------------
    def watchers(self, told: list, audit: Any) -> tuple[list, Any]:
        """The `watching=` and `auditing=` a Trainer was given, on rank 0; none on another rank,
        with a warning where some were given."""
        if self.rank == 0:
            return told, audit
        given = [n for n, it in (("watching=", told), ("auditing=", audit is not None)) if it]
        if given:
            run.warn(
                f"rank {self.rank} of {dist.get_world_size()}: the {' and '.join(given)} given "
                "to this Trainer are left out here: under parallel= rank 0 alone measures and "
                "tells the facts (docs/parallel.md), and this rank tells nothing. Give them on "
                "rank 0 only (watching=w if torch.distributed.get_rank() == 0 else None) to "
                "say so; this rank's own loss is what t.step returns"
            )
        return [], None

    def transport(self, host: str | None) -> Any:
        """How each part of the stages runs, what `Stages` asks: a part with something to
        average through its replica, any other as it would here."""
        return self._parts

    def around(self, stages: Any, optimizer: Any) -> None:
        """Put DDP (or FSDP, pointing the optimizer at the sharded parameters) around `stages`,
        with rank 0's weights on every rank first. Collective: every rank makes its Trainer."""
        graph = stages.graph
        with _ranks.answering("starting (rank 0's weights sent to every rank)"):
            if self.cuda:  # nodes placed .on("cuda") go to this rank's GPU (the current one)
                for nid, device in graph.devices().items():
                    if device == "cuda":
                        place(graph.implementation(nid), "cuda")
            _weights.broadcast_states(graph)
            modules = [m for nid in graph.nodes() for m in modules_of(graph.implementation(nid))]
            if self.mode == "fsdp":
                from somatize.torch.training import _sharded

                root = _Replica(modules, [], stages.forward)
                self._whole = _sharded.shard(root, graph, optimizer, cuda=self.cuda)
            elif stages.whole:
                self._whole = self._ddp(_Replica(modules, [], stages.forward), find_unused=True)
            else:
                self._by_part(stages)
        self._stages = stages

    def _by_part(self, stages: Any) -> None:
        owner: dict[int, str] = {}
        for part in stages.parts:
            modules = [m for nid in part.ids for m in modules_of(part.nodes[nid])]
            learning = part.learning
            extra: list[nn.Parameter] = []
            brought: list[nn.Module] = []
            if learning is not None:
                brought = [m for m in modules_of(learning) if m not in modules]
                modules += brought
                have = {id(p) for m in modules for p in m.parameters()}
                extra = [p for p in learning.training() if id(p) not in have]
            replica = _Replica(modules, extra, part.forward)
            for p in replica.parameters():
                if p.requires_grad and owner.setdefault(id(p), part.ids[0]) != part.ids[0]:
                    raise ValueError(
                        f"nodes {owner[id(p)]!r} and {part.ids[0]!r} share a parameter across "
                        "a cut: under parallel= each part of the cut averages its own "
                        "gradients, so one parameter cannot be in two; untie them, or train "
                        "without trains="
                    )
            # a Learning moves every parameter it has; in the Trainer's part a branch may not run
            # DDP finds what a step left unused by walking back from what the forward produced:
            # Split's backward starts there; one that learns from a loss of its own, or moves
            # modules it brought, is averaged without the walk, and checked (`_every_used`)
            walks = learning is None or (learning.wants_signal and not brought and not extra)
            replica = self._ddp(replica, find_unused=walks)
            if replica is not None:
                self._of[id(part)] = replica
                if not walks:
                    self._unwatched[id(part)] = _every_used(part, replica, named(stages.graph))

    def _ddp(self, replica: _Replica, find_unused: bool) -> Any:
        if not trainable(replica):
            return None  # nothing to average: the nodes run as they are
        return nn.parallel.DistributedDataParallel(replica, find_unused_parameters=find_unused)

    # -- every step -----------------------------------------------------------------------
    def even(self, data: Any) -> Any:
        """`data` as `fit` walks it, every rank taking as many batches (collective): lengths
        that differ are refused now, on every rank; data without one is walked `_InStep`."""
        try:
            n = len(data)
        except TypeError:  # no length: a generator, a DataLoader over an IterableDataset
            n = -1
        with _ranks.answering("comparing how many batches each rank has"):
            lengths = _ranks.gathered(n)
        if min(lengths) < 0:
            return _InStep(data, self.mode)
        if len(set(lengths)) > 1:
            each = ", ".join(f"rank {r} {k}" for r, k in enumerate(lengths))
            raise ValueError(
                f"parallel={self.mode!r} takes one step on every rank at once, and the ranks' "
                f"data differ in length ({each} batches), so the longer would wait for ever "
                f"in a step the others never take; nothing was trained. {_EVEN}"
            )
        return data

    def _run(self, replica: Any, sync: bool, *args: Any, **kw: Any) -> Any:
        (self._open.discard if sync else self._open.add)(id(replica))
        if self.mode == "fsdp":
            replica.set_requires_gradient_sync(sync)
        elif not sync:
            with replica.no_sync():
                return replica(*args, **kw)
        return replica(*args, **kw)

    def _part_forward(
        self, part: Any, inputs: dict[str, Any], *, store: Any = None, watching: Any = None
    ) -> dict[str, Any]:
        replica = self._of.get(id(part))
        if replica is None:
            return part.forward(inputs, store=store, watching=watching)
        learning = part.learning
        # a Learning with an `every` of its own closes its own groups; any other, the Trainer's
        sync = self.sync if learning is None or learning.declared is None else learning.closes()
        return self._run(replica, sync, inputs, store=store, watching=watching)

    def _part_backward(self, part: Any, envelopes: dict[str, Any]) -> dict[str, Any]:
        """`part.backward`; the first time, `_every_used` goes on its Learning's optimizer."""
        check = self._unwatched.pop(id(part), None)
        if check is not None:
            part.learning.optimizer.register_step_pre_hook(check)
        return part.backward(envelopes)

    def forward(self, x: Any, **how: Any) -> Any:
        """The stages' forward (`how` is what it takes besides the input: `store=`, ...),
        through DDP (FSDP)."""
        with _ranks.answering("in a forward"):
            if self._whole is not None:
                return self._run(self._whole, self.sync, x, **how)
            return self._stages.forward(x, **how)

    def backward(self, loss: Any, closing: bool = False) -> None:
        """The stages' backward; where a group closes, DDP all-reduces on the way."""
        with _ranks.answering("in a backward"):
            self._stages.backward(loss, closing)

    def update(self) -> None:
        """Close the group a run ends in the middle of: what accumulated under `no_sync` is
        averaged across the ranks, then the stages are told (refused under FSDP)."""
        if self.mode == "fsdp" and self._open:
            raise RuntimeError(
                "parallel='fsdp': a group of accumulated steps is open and update() has no "
                "backward left for FSDP to reduce it in: make the number of batches in an "
                "epoch a multiple of every"
            )
        with _ranks.answering("closing a group in update()"):
            for replica in (self._whole, *self._of.values()):  # in the same order on every rank
                if id(replica) in self._open:
                    _weights.average_grads(replica.parameters())
                    self._open.discard(id(replica))
            self._stages.update()

    # -- weights --------------------------------------------------------------------------
    def incoming(self, graph: Any, weights: Any) -> Any:
        """What `load` loads on every rank: rank 0's `weights` (the other ranks' are not
        read), sent as tensors; under FSDP laid out as the shards they go into."""
        with _ranks.answering("loading rank 0's weights"):
            given = _weights.from_rank0(weights if self.rank == 0 else None)
        if self.mode == "fsdp":
            from somatize.torch.training import _sharded

            given = _sharded.laid_out(graph, given)
        return given

    def whole(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A node's state with each sharded tensor gathered whole (collective under FSDP:
        every rank exports); under DDP the state as it is."""
        if self.mode != "fsdp":
            return state
        from somatize.torch.training import _sharded

        with _ranks.answering("gathering the weights for export"):
            return _sharded.gathered(state)


_EVEN = (
    "Give each rank its share with somatize.torch.shard (every rank gets as many samples), "
    "and the same batch_size and drop_last on every rank"
)


class _InStep:
    """Data without a length, walked by every rank in step: before each batch the ranks say
    whether they have one, and stop together; some with one and some without is refused on
    every rank, naming them, rather than leave those with one waiting for ever."""

    def __init__(self, data: Any, mode: str) -> None:
        self.data = data
        self.mode = mode

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.data)
        taken = 0
        while True:
            batch = next(batches, _InStep)  # the class itself: no batch left
            with _ranks.answering("agreeing that every rank has another batch"):
                have = _ranks.gathered(batch is not _InStep)
            if not any(have):
                return
            if not all(have):
                out = [r for r, h in enumerate(have) if not h]
                more = [r for r, h in enumerate(have) if h]
                raise ValueError(
                    f"parallel={self.mode!r} takes one step on every rank at once, and "
                    f"rank(s) {out} ran out of batches after {taken} while rank(s) {more} had "
                    f"more; the steps taken stand, the group left open is dropped. {_EVEN}"
                )
            taken += 1
            yield batch


def _every_used(part: Any, replica: Any, names: dict[int, str]) -> Callable:
    """A step pre-hook for the optimizer of `part`'s Learning: a parameter of its replica that
    got no gradient is refused before that optimizer moves, since DDP (without the walk that
    finds unused ones) waits for it and leaves the rest of its bucket unaveraged."""
    nid, learning = part.trained, part.learning

    def check(optimizer: Any, args: Any, kwargs: Any) -> None:
        unused = [q for q in replica.parameters() if q.requires_grad and q.grad is None]
        if unused:
            other = f"a parameter its {type(learning).__name__} brought"
            said = [names.get(id(q), other) for q in unused]
            raise ValueError(
                f"node {nid!r} is trained by {type(learning).__name__} under parallel='ddp', and "
                f"its parameter(s) {said} got no gradient in this step; its optimizer did not "
                "move. DDP averages the node a Learning trains without find_unused_parameters "
                "(docs/parallel.md), so it has to use every parameter it holds every step: "
                "take the unused ones out of the node, or .requires_grad_(False) on them "
                "before the Trainer is built, or train without parallel="
            )

    return check
