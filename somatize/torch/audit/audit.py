"""Watching a graph while it trains: `Audit`.

One flat `health` fact per watched place and measured step, in the published layout:
``{"fact": "health", "node": id, "inside": path or None, "step": k, <metric>: value, ...}``
(`somatize.health.METRICS` says what each metric is). What is measured, and when:

- **a measured step's first output**: θ, the weights as the step finds them, is copied; the
  update is taken against it whatever moves the weights after (the Trainer's optimizer, or a
  node's own `Learning` stepping inside backward), so every optimizer is measured alike.
- **each output, in the forward**: Σ|a|, the zero and saturated counts; with `channels`, each
  channel's activity and a hook on the input's gradient (put on before the place runs, so an
  input it writes over is heard as given); on snapshot steps (and for grouped places) up to
  128 samples copied, and a tensor hook that will hear ‖∂L/∂output‖.
- **after backward** (`observed`): ‖θ‖ and ‖∇θ‖, everything above read at once, the facts
  built (zero and saturated fractions as the max over the last `window` measured steps).
- **after the optimizer stepped** (`moved`): update_ratio from the copy, and on a snapshot
  step update_stable_rank of the update to the place's largest weight.

Module hooks (a node's on a `Holder` of its own, which the `Tap` calls it through at its id)
and tensor hooks only, never full backward hooks (those break on in-place ReLU); module hooks
are on, and the Tap `live`, only during measured steps. A forward under `torch.no_grad()` (an
evaluation between steps) is not heard, and a Trainer's step forgets what was heard before it
began; of what a place was given only the tensors' ids are kept.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Set
from typing import Any

import torch
from torch import nn

from somatize.graph import as_graph
from somatize.run import warn
from somatize.torch._modules import Held, Holder, Tap, named_modules_of
from somatize.torch.audit._measures import (
    norm,
    outside_autocast,
    read,
    squared_norms,
    stable_rank,
)
from somatize.torch.audit._place import Place, hearing, layouts, marks, swaps
from somatize.torch.audit._select import choose, partitions, preorder

__all__ = ["Audit"]


class Audit:
    """Watches the nodes of a graph and says what it saw. Built by the Trainer when
    `auditing=` is given; little reason to make one by hand except to choose a cadence or to
    declare groups, the channel partitions a node keeps apart::

        Trainer(g, ..., auditing=Audit(every=10, channels=True))
        Audit(groups={"encoder": {"audio": range(0, 64), "text": range(64, 128)}})

    `every`: measure one step in this many. `snapshot`: the costlier numbers (effective rank,
    update stable rank) on the first measured step of every `snapshot` steps. `window`: the
    measured steps zero and saturated fractions and dead channels are taken over. `inside`:
    also watch what is in each node — True for the finest cut of its modules that fits in
    `most` (the coarsest level first, so the whole net is covered), an int for the modules
    down to that depth (coarsest first, up to `most`), or a list of places (`"node.path"`).
    What `most` leaves out is warned about and listed in `left_out`. An `nn.Identity` is never
    a place of its own.

    By hand, the moments are the Trainer's: forward, backward, `observed()`, the optimizer's
    step, `moved()` (without it the facts carry no update_ratio). Refuses a cadence under 1,
    groups that are not at least two sets of channel indices, places or groups that name
    nothing in the graph, and — in a measured forward, where a place's width shows — groups
    naming a channel past it (the forward raises, and what the step heard is forgotten: a
    Trainer's step is not counted).
    """

    def __init__(
        self,
        *,
        every: int = 1,
        snapshot: int = 50,
        channels: bool = False,
        groups: Mapping[str, Mapping[str, Iterable[int]]] | None = None,
        window: int = 20,
        inside: Any = None,
        most: int = 32,
    ) -> None:
        for name, value in dict(every=every, snapshot=snapshot, window=window, most=most).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                what = "a number of places" if name == "most" else "a whole number of steps"
                raise ValueError(f"Audit({name}=...) is {what} ≥ 1, not {value!r}")
        if not isinstance(inside, (type(None), bool, int)):  # names, read once (a generator too)
            if not isinstance(inside, Iterable):
                raise ValueError(
                    f"Audit(inside=...) is True, a depth or a list of places, not {inside!r}"
                )
            inside = [inside] if isinstance(inside, str) else [str(w) for w in inside]
        self.every = every
        self.snapshot = snapshot
        self.channels = bool(channels)
        self.window = window
        self.inside = inside
        self.most = most
        self.groups = partitions(groups or {})
        self.step = 0
        #: the watched places, in graph order (a node, then what is inside it)
        self.places: list[str] = []
        #: the places `inside=` would have watched past `most`, one by one
        self.left_out: list[str] = []
        self._tap: Tap | None = None  # on the graph watched (between `watch` and `release`)
        self._places: list[Place] = []
        self._handles: list[Any] = []
        self._swaps: list[Any] = []  # the hooks that warn of a part replaced (`swaps`)
        self._flat: list[nn.Parameter] = []  # the weights the places train, each once
        self._all: list[nn.Parameter] = []  # every weight they hold, trained or frozen
        self._asking: list[bool] = []  # whether each of those asked for a gradient
        self._bucket = -1  # the last `snapshot` steps a snapshot was taken in
        self._measuring = False
        self._snap = False
        self._nested = False  # whether it watches places inside nodes
        self._runs: dict[str, int] = {}  # how many forwards of each node began (if so)
        self._running: set[str] = set()  # the nodes running now
        # θ as the measured step found it, until `moved`, and the facts waiting for it
        self._copy: list[torch.Tensor] | None = None
        self._waiting: list[tuple[bool, list[tuple[Place, dict[str, Any]]]]] = []
        #: nodes that run on a worker and are measured there (a Trainer's stage says so)
        self.elsewhere: set[str] = set()
        self._far: list[dict[str, Any]] = []  # their facts, come back from the worker

    def __repr__(self) -> str:
        watching = f", watching {len(self._places)} places" if self._tap is not None else ""
        return f"Audit(every={self.every}, step={self.step}{watching})"

    # -- which places ---------------------------------------------------------------------
    def watch(self, graph: Any) -> Audit:
        """Hooks every node of this graph, and — with `inside=` — what is in it.

        What comes back is keyed by node, and by `node.path.to.submodule` for anything inside
        one. A node that runs on a worker (`.at(host)`) is left out, with one warning naming
        it: the copy here never runs nor learns. Refuses a second graph before `release()`,
        and groups or places that name nothing there.
        """
        if self._tap is not None:
            raise RuntimeError("this Audit already watches a graph: release() it first")
        g = as_graph(graph)
        away = g.hosts()  # run on a worker: the copy here neither runs nor learns
        held_by = {
            node: named_modules_of(g.implementation(node)) for node in g.nodes() if node not in away
        }
        Held(
            [m for held in held_by.values() for _, m in held],
            [node for node, held in held_by.items() for _ in held],
        ).refuse(
            "an Audit measures weights that are there when it starts watching", reads="an Audit"
        )
        places: list[Place] = []
        left: list[str] = []
        for node, held in held_by.items():
            first = layouts([m for _, m in held])  # a node gives what its last module gives
            last = first[id(held[-1][1])] if held else False
            called = Holder(g.implementation(node))  # what the Tap calls it through, hooked
            places.append(Place(node, None, called, self.window, last))
            chosen, missed = choose(node, held, self.inside, self.most)
            places += [Place(node, p, m, self.window, first.get(id(m), False)) for p, m in chosen]
            left += [f"{node}.{p}" for p in missed]
        by_where = {p.where: p for p in places}
        missing = sorted(set(self.inside) - set(by_where)) if isinstance(self.inside, list) else []
        if missing:
            raise ValueError(
                f"Audit(inside=...) names {missing}, which are not in this graph: a place "
                f"is named node.path.to.module{_like(missing, held_by)}{_elsewhere(missing, away)}"
            )
        missing = sorted(set(self.groups) - set(by_where))
        if missing:
            raise ValueError(
                f"Audit(groups=...) names {missing}; the places are {sorted(by_where)[:12]}"
                f"{_elsewhere(missing, away)}"
            )
        unheard = {n: h for n, h in away.items() if n not in self.elsewhere}
        if unheard:
            said = ", ".join(f"{n!r} (host {h!r})" for n, h in sorted(unheard.items()))
            warn(
                f"this Audit leaves out node(s) {said}: they run and learn on a worker, and the "
                "audit measures weights, gradients and activations in this process, where the "
                "copy of such a node never runs nor moves (its numbers would say STALLED of a "
                "node that is learning). To audit it, train it in one process (without .at)"
            )
        for where, parts in self.groups.items():
            by_where[where].groups = parts
        if left:
            warn(
                f"Audit(inside={self.inside!r}) watches {len(places) - len(held_by)} places "
                f"inside the nodes (most={self.most} per node); {len(left)} more are seen only "
                f"through the modules that hold them ({', '.join(left[:4])}"
                f"{', …' if len(left) > 4 else ''}): raise most= to watch them one by one (the "
                "list is in audit.left_out)"
            )
        self._places, self._swaps = places, swaps(held_by)
        self._all = list({id(q): q for place in places for q in place.weights}.values())
        self._weigh()
        self.places = [p.where for p in places]
        self.left_out = left
        self._nested = any(p.inside is not None for p in places)
        self._tap = Tap(g, None, {p.node: p.module for p in places if p.inside is None}).on()
        self._arm(self.step % self.every == 0)
        return self

    def release(self) -> None:
        """Takes the hooks off. A hook nobody removed is a graph nobody can garbage-collect,
        and a second watch would double every count."""
        self._arm(False)
        if self._tap is not None:
            self._tap.off()
        for handle in self._swaps:
            handle.remove()
        self._tap = self._copy = None
        self._waiting, self._far, self._places, self._swaps = [], [], [], []
        self._all = self._flat = []

    def _arm(self, measuring: bool) -> None:
        """Module hooks are on, and the Tap calls nodes through their `Holder`s, only for a
        measured step: an unmeasured one pays the Tap's call per node, and a module with no
        hooks takes torch's fast path."""
        self._measuring = measuring
        self._snap = measuring and self.step // self.snapshot != self._bucket
        if self._tap is not None:
            self._tap.live = measuring
        if measuring and not self._handles:
            for place in self._places:
                module, heard = place.module, functools.partial(self._heard, place)
                self._handles.append(module.register_forward_hook(heard, with_kwargs=True))
                if place.inside is None and self._nested:
                    enters = functools.partial(self._enters, place.node)
                    leaves = functools.partial(self._leaves, place.node)
                    self._handles.append(module.register_forward_pre_hook(enters))
                    self._handles.append(module.register_forward_hook(leaves, always_call=True))
                if self.channels:
                    before = functools.partial(self._before, place)
                    self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        elif not measuring and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

    # -- a node measured on its worker -------------------------------------------------------
    def settings(self, nodes: Iterable[str]) -> dict[str, Any]:
        """The arguments of an Audit like this one for `nodes` alone: what a worker that runs
        them builds its own from (`inside=` places and `groups=` of other nodes left out)."""
        nodes = set(nodes)
        inside = self.inside
        if isinstance(inside, list):
            inside = [w for w in inside if w.split(".")[0] in nodes]
        kept = ("every", "snapshot", "channels", "window", "most")
        return {k: getattr(self, k) for k in kept} | {
            "inside": inside,
            "groups": {w: g for w, g in self.groups.items() if w.split(".")[0] in nodes},
        }

    @property
    def watching(self) -> bool:
        """Whether it watches a graph (between `watch` and `release`)."""
        return self._tap is not None

    def at(self, step: int | None) -> None:
        """The Trainer's step the next forward belongs to (measured or not by this audit's
        cadence): told on a worker each step, and here when a resumed run sets `t.steps`;
        None once the Trainer's audit no longer watches. Snapshots go on as they would have
        (at the first measured step of every `snapshot` steps), from the step resumed at."""
        if step is None:
            self._arm(False)
        elif step != self.step:
            self.step = step
            bucket = step // self.snapshot
            first = -(-bucket * self.snapshot // self.every) * self.every  # its first measured
            self._bucket = bucket if first < step else bucket - 1
            self._arm(step % self.every == 0)

    def heard(self, facts: list[dict[str, Any]]) -> None:
        """Facts measured on a worker, complete (update_ratio and all): `arrived` hands them
        on (dropped once released)."""
        if self._tap is not None:
            self._far += facts

    def arrived(self) -> list[dict[str, Any]]:
        """The facts `heard` since the last time it was asked."""
        far, self._far = self._far, []
        return far

    # -- forward: what came out -----------------------------------------------------------
    def _before(self, place: Place, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._measuring and hearing() and self._fresh(place):  # (`channels`)
            place.given(_given(place, args, kwargs), self.step)

    def _heard(self, place: Place, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self._measuring and hearing() and self._fresh(place):
            if self._copy is None:
                self._begin()
            try:
                place.saw(_given(place, args, kwargs), out, self.step, self.channels, self._snap)
            except ValueError:  # its groups past its width (`Place._fits`): the step heard nothing
                self.forget()
                raise

    def _fresh(self, place: Place) -> bool:
        """Whether a call of `place` is heard. A node's, and a module's inside it during the
        node's forward, yes; during another node's, no (each id of a node standing at two hears
        its own); outside any, only where its node's forward was not heard: checkpointing runs
        a block's forward again inside backward (non-reentrant, stopping once backward has what
        it needs; re-entrant, after a first run under no_grad), never before its node ran."""
        node = place.node
        if place.inside is None:
            return True
        if node in self._running:
            place.run = self._runs[node]
            return True
        return not self._running and place.run != self._runs.get(node, place.run)

    def _enters(self, node: str, module: nn.Module, args: tuple) -> None:
        """A node begins its forward (heard where places inside nodes are watched)."""
        self._runs[node] = self._runs.get(node, 0) + 1
        self._running.add(node)

    def _leaves(self, node: str, module: nn.Module, args: tuple, out: Any) -> None:
        """It ends it (or raised)."""
        self._running.discard(node)

    def _begin(self) -> None:
        """θ as this measured step finds it, copied once, kept until `moved` (under gradient
        accumulation the steps of one group share one copy and one update); the weights
        trained read again first if one was frozen or unfrozen since."""
        if [q.requires_grad for q in self._all] != self._asking:
            self._weigh()
        if self._flat:
            with torch.no_grad():
                self._copy = [q.clone() for q in self._flat]

    def _weigh(self) -> None:
        """Which weights each place trains (those asking for a gradient), where each sits in
        the flat list copied; a place whose weights changed starts its slope's window again."""
        slot: dict[int, int] = {}  # every place's weights once (a layer's are its node's)
        for place in self._places:
            params = [q for q in place.weights if q.requires_grad]
            if [id(q) for q in params] != [id(q) for q in place.params]:
                place.params = params
                place.norms.clear()
            place.index = [slot.setdefault(id(q), len(slot)) for q in params]
            big = max(params, key=lambda q: q.numel(), default=None)
            place.big = slot[id(big)] if big is not None and big.dim() >= 2 else -1
        self._flat = list({id(q): q for place in self._places for q in place.params}.values())
        self._asking = [q.requires_grad for q in self._all]

    def dropped(self) -> None:
        """A step raised and its group was dropped (a loss not finite, Ctrl-C): what the step
        heard is forgotten, and the steps measured in the group wait for no update."""
        self._waiting = []
        self.forget()

    def forget(self) -> None:
        """Forgets what was heard since the last step, and θ's copy unless a measured step waits
        for it. A Trainer calls it as a step begins: a forward with gradients on between steps
        (an evaluation without `torch.no_grad()`) is not the step's."""
        for place in self._places:
            place.clear()
        if not self._waiting:
            self._copy = None

    # -- after backward: the step's numbers ------------------------------------------------
    def observed(self, graph: Any = None) -> list[dict[str, Any]]:
        """One health fact per node, for the step that just finished.

        Called after backward (and before the optimizer steps), the only moment when this
        step's activations and the gradients for them are both in hand. Empty on an
        unmeasured step. Refused before `watch`. A fact whose place has weights gets
        update_ratio when `moved` is told the optimizer stepped (the Trainer holds the facts
        until then).
        """
        if self._tap is None:
            raise RuntimeError("observed() before watch(graph): nothing is being watched")
        step = self.step
        facts: list[dict[str, Any]] = []
        try:  # the step counts even if this is interrupted (Ctrl-C), as a Trainer's does
            if self._measuring:
                if self._snap:
                    self._bucket = step // self.snapshot
                if self._copy is None:  # nothing of this graph ran here (or nothing was heard)
                    self._begin()
                with torch.no_grad(), outside_autocast():  # measured in their own dtypes
                    measured = self._measure(step, self._snap)
                facts = [fact for _, fact in measured]
                waits = [(p, f) for p, f in measured if p.index]
                if waits:
                    self._waiting.append((self._snap, waits))
        finally:
            self.step = step + 1
            self._arm(self.step % self.every == 0)
        return facts

    def _measure(self, step: int, snapshot: bool) -> list[tuple[Place, dict[str, Any]]]:
        """Every place's numbers for this step, from one read of everything left as tensors:
        ‖θ‖ of each weight (on the copy: the weights the step ran with), ‖∇θ‖ of each that
        has a gradient, and what each place heard."""
        copy = self._copy or []  # θ as `_begin` copied it
        grads = [q.grad for q in self._flat]
        normed = copy + [g for g in grads if g is not None]
        tensors = [norm(t) for t in normed]
        for place in self._places:
            place.queue(tensors)
        values = read(tensors)
        squares = squared_norms(values[: len(normed)], normed)
        after = iter(squares[len(copy) :])  # ‖∇θ‖² of each weight that has a gradient
        grad_squares = [None if g is None else next(after) for g in grads]
        spoilt, blank = marks(self._places, values)  # calls not finite, outputs all zero
        out = []
        for place in self._places:
            weights = [squares[i] for i in place.index]
            got = [grad_squares[i] for i in place.index if grad_squares[i] is not None]
            n = place.numbers(values, weights, got, step, snapshot, spoilt, blank)
            place.clear()
            if n:
                fact = {"fact": "health", "node": place.node, "inside": place.inside, "step": step}
                out.append((place, fact | n))
        return out

    # -- after the optimizer stepped --------------------------------------------------------
    def moved(self, trained: Set[torch.Tensor] | None = None) -> None:
        """Tells the audit the optimizer has stepped: the facts of the measured steps that went into
        this update get `update_ratio` (‖θ' − θ‖/‖θ‖, θ the weights the step ran with, taken on
        the copy made when it began) and, on a snapshot step, `update_stable_rank` of that update
        to the place's largest weight. The Trainer calls it after each update; by hand, call it
        after `optimizer.step()`. A place whose weights this update left exactly as they were,
        where some update has moved them before (a node trained by its own `Split(every=k)`),
        gets no ratio that step rather than a 0 that reads as STALLED; nor do weights all zero
        when first weighed, for `window` measured steps after, nor a place holding none of the set
        `trained` (the Trainer's: a GAN's discriminator under the generator's). Nothing is done
        when no measured step waits for one."""
        copy, self._copy = self._copy, None
        waiting, self._waiting = self._waiting, []
        if copy is None or not waiting:
            return
        with torch.no_grad(), outside_autocast():
            # a weight given another shape or device between has nothing to compare with
            same: list[bool] = []
            for c, q in zip(copy, self._flat, strict=True):
                same.append(c.shape == q.shape and c.device == q.device)
                if same[-1]:
                    c.sub_(q)  # −Δθ
            squares = squared_norms(read([norm(d) for d in copy]), copy)
            ranked = any([snapshot for snapshot, _ in waiting])
            places = dict.fromkeys([place for _, got in waiting for place, _ in got])
            places = [p for p in places if trained is None or not trained.isdisjoint(p.params)]
            moves = {place: _moved(place, copy, squares, same, ranked) for place in places}
            for snapshot, got in waiting:
                for place, n in got:
                    delta, stable = moves.get(place, (None, None))  # None: not this update's
                    was = n.get("param_norm")
                    if delta is None or not was or n["step"] <= place.grown_after:
                        continue  # (weights grown from zero: ‖Δθ‖/‖θ‖ counts their steps)
                    n["update_ratio"] = delta / was
                    if snapshot and stable is not None:
                        n["update_stable_rank"] = stable


def _given(place: Place, args: tuple, kwargs: dict) -> Any:
    """What a place's hooks see it given: a module's every argument; a node's input alone (its
    `Holder` is called as the engine calls it, `(input, ctx)`, and a ctx holds no tensor)."""
    if place.inside is not None:
        return args, kwargs
    return args[0] if args else kwargs.get("input")


def _moved(
    place: Place, deltas: list[torch.Tensor], squares: list[float], same: list[bool], snapshot: bool
) -> tuple[float | None, float | None]:
    """‖Δθ‖ of a place (None: no ratio this time) and, on a snapshot, the stable rank of the
    update to its largest weight (None when that is not a matrix); notes that it has moved."""
    index = place.index
    if not all([same[i] for i in index]):
        return None, None  # a weight was given other memory between: nothing to compare
    moved = math.sqrt(sum([squares[i] for i in index]))
    if moved == 0.0 and place.has_moved:
        return None, None  # waiting for an update of its own
    if moved:  # (a NaN too)
        place.has_moved = True
    return moved, stable_rank(deltas[place.big]) if snapshot and place.big >= 0 else None


def _like(missing: list[str], held_by: dict[str, list]) -> str:
    """The places whose names end as a missing one does (`features.0`: `audio.features.0`)."""
    found = [f"{node}.{path}" for node, held in held_by.items() for path, _ in preorder(held)]
    like = [w for w in found if any(w.endswith("." + m) for m in missing)]
    return f" (say {like[:4]})" if like else ""


def _elsewhere(names: list[str], away: dict[str, str]) -> str:
    """What to add to a refusal of `names` when some are in a node that runs on a worker."""
    far = sorted({n.split(".")[0] for n in names} & set(away))
    return f" (node(s) {far} run on a worker, which the audit does not watch)" if far else ""
