"""Trainer: trains a graph without the graph finding out. Without a cut a step is
`graph.forward`, `loss.backward()` and `optimizer.step()`; a node trained by a `Learning` or on
another host is a cut, run stage by stage (`somatize.torch.training.stages`)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from somatize import run
from somatize.graph import Graph, as_graph, broker_for
from somatize.node import to_call
from somatize.store import store_of
from somatize.torch._served import stage_state
from somatize.torch.audit._measures import outside_autocast
from somatize.torch.training import _checks, brought
from somatize.torch.training._micro import pieces
from somatize.torch.training._progress import Progress, live_shown, person_watching
from somatize.torch.training._result import Result
from somatize.torch.training.learning import Learning
from somatize.torch.training.parallel import parallel_of
from somatize.torch.training.params import freeze, named, state_of, trained
from somatize.torch.training.remote import Remote
from somatize.torch.training.stages import Stages, untied

__all__ = ["Trainer", "Result", "NoGradient"]


Batch = Any
Weights = dict[str, dict[str, torch.Tensor]]


class NoGradient(RuntimeError):
    """A node none of whose parameters the optimizer holds got a gradient: a cut (the loss does
    not reach the node). Raised before the optimizer moves, naming the parameters by their
    qualified names (`body.pooler.dense.weight`). A cut on purpose is said by taking those
    parameters out of the optimizer (`parameters(g, without=...)`) or declaring the node
    `.frozen()`."""


def _released(audit: Any, stages: Stages) -> None:
    audit.release()
    stages.recompile()


class Trainer:
    """Trains a graph, without the graph finding out::

        t = Trainer(g, objective=cross_entropy,
                    optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
        t.fit(data, epochs=10)

    `objective(output, target)` gives the loss; a batch is `(input, target)`. The optimizer is
    the caller's, and may hold a subset of the graph's parameters (the rest are not trained).
    `trains={node: Learning}` puts a trainer beside a node (its weights come out of this
    optimizer: `parameters(g, without=trains)`). `every` is how many steps go into one update and
    `micro` how many pieces one batch is cut into; they multiply. `store` (a Store or a
    directory) makes a settled `.cached()` prefix run once per batch. `broker` says where
    `.at(host)` nodes run. `watching` is told every fact (the engine's, `loss`, `updated`, and
    with `auditing=` an Audit or True, `health`, told before the `updated` of the update the
    measured step went into); one with a `flush()` is flushed after each step. In a notebook an
    audited `fit` shows a `LiveAudit`, kept as `t.live`, unless one is already watching.
    `parallel="ddp"` (or `"fsdp"`), in a script torchrun starts once per rank, trains
    data-parallel: each rank steps on its own data, rank 0 tells the facts. `finite=True`
    stops at a loss that is NaN or infinite: a `FloatingPointError` before its backward, the
    weights as the last update left them. Under `torch.autocast` each forward starts from the
    weights as they are (autocast's cache is cleared) and the backward and the audit run
    outside it, so a whole `fit` may be wrapped in one.

    Refused, each saying what to do: a graph with no parameter to train; `trains` naming no
    node, a node with no parameters, or holding no Learning; a node both frozen and trained;
    an optimizer holding parameters of a node in `trains`, sharing none with the graph, or
    whose `step` needs a closure (LBFGS); weights on the meta device (a node's, or the
    optimizer's, built before `to_empty` gave the node new ones);
    nothing to train with (no optimizer and no `trains`); bad `every`, `micro`; `micro` > 1 on a
    graph holding an RNN or Transformer layer built with `batch_first=False`, or a BatchNorm
    in a node not declared `.frozen()` (pieces would be normalised apart); a `watching=`
    or `auditing=` that cannot be used (a `TypeError` that is also a `ValueError`);
    `.at(host)` nodes without a broker. A refused Trainer changes nothing.
    """

    def __init__(
        self,
        graph: Graph,
        *,
        objective: Callable[[Any, Any], Any],
        optimizer: Any = None,
        trains: dict[str, Learning] | None = None,
        every: int = 1,
        micro: int = 1,
        store: Any = None,
        broker: Any = None,
        watching: Any = None,
        auditing: Any = None,
        parallel: str | None = None,
        finite: bool = False,
    ) -> None:
        graph = as_graph(graph)  # a bare module is a graph of one node; anything else refused
        to_call(objective, "objective=", "a loss function, called as objective(output, target)")
        if type(finite) is not bool:
            raise TypeError(
                f"finite is True (stop at a loss that is NaN or infinite) or False, not {finite!r}"
            )
        self.every = _checks.count(every, "every", "how many steps go into one update")
        self.micro = _checks.count(
            micro, "micro", "how many equal pieces one batch is cut into along its first dimension"
        )
        _checks.batch_first(graph, self.micro)
        told = _checks.watchers_of(watching)
        _checks.something_to_train(graph)
        trains = _checks.trains_of(graph, trains)
        untied(graph, trains)  # before what the optimizer holds: a tie makes that misleading
        _checks.materialised(graph, optimizer)
        held = _checks.held_by(graph, optimizer, trains)
        _checks.closed_over(graph, optimizer)
        audit = _checks.audit_of(auditing)
        self.store = None if store is None else store_of(store)
        self._parallel = parallel_of(
            parallel,
            graph,
            trains=trains,
            optimizer=optimizer,
            store=self.store,
            audit=audit,
            every=self.every,
            micro=self.micro,
        )
        if self._parallel is not None:  # rank 0 tells the facts; another warns of any given
            told, audit = self._parallel.watchers(told, audit)
        hosts = {nid: host for nid, host in graph.hosts().items() if host}
        broker_for(hosts, broker, "Trainer(..., broker=Broker.embedded({%s: Worker.at(...)}))")
        remotes = {host: Remote(broker, host) for host in sorted(set(hosts.values()))}

        # Everything is checked: from here on, things change.
        freeze(graph)
        for nid, learning in trains.items():
            learning.of(graph.implementation(nid)).accumulating(self.every)
            learning.tell(
                every=learning.every, pieces=self.micro, objective=objective, outer=self.every
            )
        self.graph = graph
        self.objective = objective
        self.optimizer = optimizer
        self.trains = trains
        self.broker = broker
        self.watching = told
        self.finite = finite
        self._groups = -1  # how many param groups the optimizer had when `_trained` was read
        self._trained: list = []  # the modules of the nodes this run trains
        self._weights: set = set()  # their weights: what an update is for (the audit's `moved`)
        self._count = 0
        self._steps = 0
        self._updated = 0  # the steps taken when update() last closed every group
        p = self._parallel
        self._stages = Stages(
            graph, trains, transport=remotes.get if p is None else p.transport, watching=told
        )
        if p is not None:  # DDP (FSDP) around the stages, rank 0's weights on every rank
            p.around(self._stages, optimizer)
            held = _checks.held_by(graph, optimizer, trains)  # FSDP's are new parameters
        self._unproven = held  # the nodes not yet seen to get a gradient
        self._health: list[dict] = []  # the audit's facts, until the update they wait for
        self.live: Any = None
        self.result = Result()  # the latest fit's, filled in as it goes
        self.audit = self._release = None
        if audit is not None:
            self._stages.audited(audit)  # a node on a worker is measured there
            self.audit = audit.watch(graph)
            self._stages.recompile()
            self._release = weakref.finalize(self, _released, self.audit, self._stages)

    # -- training -------------------------------------------------------------------------
    def step(self, batch: Batch) -> float:
        """One step: forward, loss, backward, and update when the group closes; answers the loss
        of the whole batch (the mean over `micro` pieces; divided by `every * micro` for the
        backward only). An `Opaque` in the batch is taken off first. Refused before anything
        runs: grad mode off (`torch.no_grad()`), or inference mode on; under `micro` > 1, a
        batch that cannot be cut (docs/training.md says what is cut). `NoGradient` before the
        optimizer moves if a node it holds parameters of got no gradient at all.

        A node it trains (the optimizer holds its parameters, or `trains` names it) that is in
        eval mode, as `net.eval()` for a validation pass leaves it, is put back in train mode
        first (`module.train()`); a submodule set to eval in a node in train mode, a frozen
        node and one the optimizer does not hold are left as they are."""
        x, y = _checks.pair_of(batch)  # grad mode on, checked too
        micro = self.micro
        xs, ys = pieces(x, y, micro) if micro > 1 else ((x,), (y,))
        try:
            self._train_mode()
            if self.audit is not None:  # what it heard since the last step is not this one's
                self.audit.forget()
            if self._count == 0 and self.optimizer is not None:
                self.optimizer.zero_grad()
            closing = self._count + 1 >= self.every
            parallel = self._parallel
            runs = parallel or self._stages  # under parallel=, through DDP (FSDP)
            scale = self.every * micro
            total = 0.0
            for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
                sync = closing and k == micro - 1
                if parallel is not None:  # a piece that does not close runs under no_sync
                    parallel.sync = sync
                torch.clear_autocast_cache()  # under autocast, the weights as they are now
                loss = _checks.one_loss(
                    self.objective(runs.forward(x, store=self.store, target=y), y)
                )
                if self.finite:
                    _checks.finite(loss, self.graph, self._steps, k if micro > 1 else None)
                with outside_autocast(loss.device.type):  # torch's recipe
                    runs.backward(loss / scale if scale != 1 else loss, sync)
                if micro > 1:
                    total += loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
            value = loss.item() if micro == 1 else float(total) / micro
            self._count += 1
            step = self._steps
            self._steps += 1
            told = self.watching
            if told:
                run.tell(told, {"fact": "loss", "value": value, "step": step})
                if not self._stages.whole:
                    fwd, back = self._stages.crossed()
                    run.tell(
                        told, {"fact": "crossed", "step": step, "forward": fwd, "backward": back}
                    )
            if self.audit is not None:  # its facts wait for their update (`moved` fills it in)
                facts = self.audit.observed(self.graph)
                if told and facts:
                    self._health += facts
            if closing:
                self._apply(step)
            run.flush(self.watching)
            return value
        except BaseException:  # an error, or Ctrl-C, half way through: its group is dropped
            self._drop()
            raise

    def _drop(self) -> None:
        """Forgets the open group: its gradients are cleared, the next step opens a new one; the
        audit forgets what the step heard, and the facts of the group go without an update."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self._count = 0
        if self.audit is not None:
            self.audit.dropped()
            self.audit.at(self._steps)  # a step counted before it raised is the audit's too
        self._unwaited()

    def _unwaited(self) -> None:
        """Tells the audit's facts still waiting for an update that will not come."""
        if self._health:
            run.tell(self.watching, *self._health)
            self._health = []

    def _train_mode(self) -> None:
        """Puts the nodes this run trains that are in eval mode in train mode."""
        groups = 0 if self.optimizer is None else len(self.optimizer.param_groups)
        if groups != self._groups:  # read again when a param group is added mid-run
            self._groups = groups
            self._trained = trained(self.graph, self.optimizer, self.trains)
            self._weights = {q for m in self._trained for q in m.parameters()}
        for module in self._trained:
            if not module.training:
                module.train()

    def _apply(self, step: int) -> None:
        optimizer = self.optimizer
        if optimizer is not None:
            if self._unproven:
                self._prove()
            optimizer.step()
        self._count = 0
        told = self.watching  # the audit's facts wait only while somebody watches
        if self.audit is not None:
            self.audit.moved(self._weights)
            far = self.audit.arrived()  # the facts of the nodes measured on a worker
            if told:
                self._health += far
        if told:
            run.tell(told, *self._health, {"fact": "updated", "step": step})
            self._health = []

    def _prove(self) -> None:
        """Forgets the nodes whose held parameters got a gradient; refuses any none of whose did."""
        cut = {
            nid: params
            for nid, params in self._unproven.items()
            if not any(p.grad is not None for p in params)
        }
        self._unproven = cut
        if not cut:
            return
        self._count = 0  # the next step opens a new group, and is checked again
        names = named(self.graph)
        said = "; ".join(
            f"{nid!r}: {', '.join(names.get(id(p), '?') for p in params)}"
            for nid, params in cut.items()
        )
        raise NoGradient(
            f"the loss reaches no parameter of node(s) {sorted(cut)} that the optimizer holds "
            f"({said}); the optimizer did not move. That is a cut: the node is before one "
            "trained by a Learning that hands no gradient back (Greedy, ForwardForward), or "
            "what it produces does not reach the objective. If that is on purpose, take them "
            f"out of the optimizer, parameters(g, without={sorted(cut)!r}), or declare the "
            "node .frozen(); otherwise check that the objective uses what the node produces"
        )

    def update(self) -> bool:
        """Applies what has been accumulated and starts a new group, for the group a run ends
        in the middle of: the Trainer's, and that of a Learning with an `every` of its own
        (across a cut, an empty envelope says so). Does nothing, and answers False, if none is
        open."""
        if not self._open():
            return False
        self._updated = self._steps
        (self._parallel or self._stages).update()
        if self._count:
            self._apply(self._steps - 1)
        run.flush(self.watching)
        return True

    def _open(self) -> bool:
        """Whether a group is open: the Trainer's, or a Learning's with an `every` of its own."""
        since = self._steps - self._updated
        return self._count > 0 or any(since % learning.every for learning in self.trains.values())

    @property
    def steps(self) -> int:
        """How many steps this run has taken: the `step` its next facts say (`loss`, the audit's
        `health`). Saved with a checkpoint and set on resuming, `t.steps = n`, the steps go on
        from there, not from 0 again. Refused while a group is open (save between updates)."""
        return self._steps

    @steps.setter
    def steps(self, n: int) -> None:
        _checks.resumable(n, self._open())
        self._steps = self._updated = n
        if self.audit is not None:  # its cadence (`every`, `snapshot`) goes on from there too
            self.audit.at(n)

    def fit(self, data: Iterable[Batch], epochs: int = 1) -> Result:
        """Takes one step per batch, for as many epochs as you say, and applies a group left half
        open at the end of each; `data` is walked once per epoch, so with more than one it has to be
        re-iterable (a generator is refused). Under `micro` > 1 a DataLoader with a batch it
        does not divide (the last, without `drop_last=True`) is refused before the first step.
        A progress bar shows when a person is watching.

        The Result is `self.result` as well, filled in step by step: a fit stopped by an error or
        Ctrl-C leaves the losses it took there. Such a fit, or a step that raises once it has
        begun, drops the group it leaves open (the gradients it accumulated are cleared: the
        next step starts a new group, as the next fit would); a node trained by a Learning
        keeps the group of its own until its next update."""
        if type(epochs) is not int or epochs < 0:
            raise ValueError(
                f"epochs is how many times to walk the data, an int >= 0, not {epochs!r}"
            )
        if epochs > 1 and isinstance(data, Iterator):
            raise TypeError(
                f"fit walks the data once per epoch, and a {type(data).__name__} is exhausted "
                "by the first: pass a list, a DataLoader, or anything iterable again"
            )
        _checks.ragged(data, self.micro)
        p = self._parallel  # every rank takes as many steps, checked (collective)
        walked = data if p is None else p.even(data)
        result = self.result = Result()
        history = result.history
        if self.audit is not None and self.live is None:  # once, kept as `self.live`
            self.live = live_shown(self.watching)
            if self.live is not None:
                self.watching = [*self.watching, self.live]
        bar = Progress(data, epochs) if person_watching() and (p is None or p.rank == 0) else None
        try:
            for _ in range(epochs):
                began = len(history)
                for batch in walked:
                    start = time.perf_counter()
                    history.append(self.step(batch))
                    result.seconds.append(time.perf_counter() - start)
                    if bar is not None:
                        bar.step(history[-1])
                self.update()
                if len(history) > began:
                    result.epochs.append(sum(history[began:]) / (len(history) - began))
        except BaseException:  # Ctrl-C between two steps: the group it leaves open is dropped
            self._drop()
            raise
        finally:
            if bar is not None:
                bar.close(history)
        return self.result

    # -- weights --------------------------------------------------------------------------
    def export(self) -> Weights:
        """What this run learnt: `{node id: {state_dict key: tensor}}`, buffers included, a
        detached copy without the optimizer's state. A node on another host is asked of its worker;
        one that lost them (it was restarted) is `StateLost`, never weights older than it learnt."""
        out: Weights = {}
        for nid in self.graph.nodes():
            if self.graph.setting(nid).host:
                state = self.broker.weights(self.graph, nid)
            else:
                state = state_of(self.graph.implementation(nid))
                if self._parallel is not None:  # whole tensors out of FSDP's shards
                    state = self._parallel.whole(state)
            state = {**state, **brought.learnt(self, nid)}
            if state:
                out[nid] = {k: t.detach().clone() for k, t in state.items()}
        return out

    def load(self, weights: Weights, *, strict: bool = False) -> None:
        """The mirror of `export`, all or nothing: every node named has to be here and hold
        weights, and every key given has to be one of its keys with the same shape (cast to the
        node's dtype). A subset is taken, as `load_state_dict(strict=False)` takes it: the nodes
        and keys left out keep the weights they have (`StateLost.exported` holds only the nodes
        a worker lost). `strict=True` refuses weights that leave out a node with weights or a
        key of one, naming them. All is checked and copied aside first, on workers too, and only
        then copied in; a refusal, or a worker that dies on the way, leaves every weight as it
        was."""
        if self._parallel is not None:  # rank 0's weights, on every rank
            weights = self._parallel.incoming(self.graph, weights)
        if not isinstance(weights, dict):
            raise TypeError(f"load takes {{node: {{key: tensor}}}}, not {type(weights).__name__}")
        commits = []
        entries: list[tuple] = []  # (host, id, node or Learning, device, state), for workers
        for nid, given in weights.items():
            node = self.graph.implementation(nid) if nid in self.graph else None
            if node is None or not state_of(node):
                has = [n for n in self.graph.nodes() if state_of(self.graph.implementation(n))]
                raise ValueError(
                    f"the weights name node {nid!r}, which this graph "
                    f"{'does not have' if node is None else 'holds no weights in'}; "
                    f"the nodes with weights are {has}; nothing was loaded"
                )
            if not isinstance(given, dict):
                raise ValueError(f"node {nid!r}: weights are {{key: tensor}}, not {given!r:.60}")
            given, theirs = brought.parted(self, nid, given)
            commits.append(stage_state(node, given, name=f"node {nid!r}"))
            if self.graph.setting(nid).host:
                entries.append((*self.broker.placement(self.graph, nid), given))
            if theirs:
                learning, host = brought.there(self, nid)
                name = f"the {type(learning).__name__} training node {nid!r}"
                commits.append(stage_state(learning, theirs, name=name))
                if host is not None:
                    entries.append((host, f"{nid}/learning", learning, None, theirs))

        brought.tied(self, weights)
        if strict:
            brought.whole(self, weights)

        def commit() -> None:
            for done in commits:
                done()

        if entries:
            for nid in weights:  # what trains it there goes on from its copy here
                if nid in self.trains and self.graph.setting(nid).host:
                    self.broker.resume(self.trains[nid])
            self.broker.write(entries, then=commit)
        else:
            commit()

    def close(self) -> None:
        """Takes the audit's hooks off and stops auditing (done too when the Trainer is garbage);
        training goes on without it."""
        self._unwaited()
        if self._release is not None:
            self._release()  # a finalizer runs once: called again, it does nothing
            self.audit = None

    def __repr__(self) -> str:
        return (
            f"Trainer({self.graph!r}, every={self.every}, micro={self.micro}, "
            f"trains={sorted(self.trains)}, steps={self._steps})"
        )
