"""Watching a graph while it trains: `Audit`.

One `health` fact per watched place and measured step, keyed by `node` or
`node.path.to.submodule`; `somatize.health` turns what was recorded into verdicts. What is
measured where:

- every place with parameters: grad_norm, param_norm, update_ratio (‖θ' − θ‖/‖θ‖: θ the
  weights the measured step ran with, θ' the weights after the update its gradient went into;
  filled into the step's facts by `Audit.moved`, which the Trainer calls after each update and
  tells the facts only then; θ' − θ is taken on a copy of θ, or — when the Trainer's torch
  SGD step is what moves the weights, and their version counters say it moved each once — read
  from that step: lr·‖g‖, or lr·‖momentum buffer‖);
- every place's output: act_mean, zero and saturated fractions (the max over the last `window`
  measured steps), nan and inf;
- on snapshot steps: effective_rank of the output (and rank_room, the most it could be),
  out_grad_norm (‖∂L/∂output‖, retained or from a tensor hook: keeping that gradient cost
  about 6 % of a 0.6 ms step at every=1), and
  update_stable_rank of that update to the place's largest weight (with the update ratio);
- with `channels`: channels, dead_channels (never active over the window), dormant_channels
  (activity under a tenth of the layer's mean this step);
- with `groups`: cka, the largest linear CKA between two declared channel groups.

Forward hooks and tensor hooks only, never full backward hooks (those break on in-place ReLU).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import optimizer as _optim

from somatize.torch._modules import Tap, as_graph, join, named_modules_of, tensors_in
from somatize.torch.audit._measures import (
    _DEAD_EPS,
    _HIGH,
    _LOW,
    channel_view,
    cka,
    dense,
    later_sums,
    numpy_views,
    read,
    spectra,
    square_of,
    squares_of,
    stable_of,
)
from somatize.torch.audit._place import _Place

__all__ = ["Audit"]

_DORMANT_TAU = 0.1
_ROWS = 1024
_AS_IS = contextlib.nullcontext()  # no errstate where no flag can be set


def _sgd_groups(optimizer: Any, flat: list[nn.Parameter]) -> list[dict[str, Any]] | None:
    """The param group of each of `flat`, when `optimizer` is torch's own `SGD` and its step
    moves each of them by −lr·g, or by −lr·buf with momentum (buf its momentum buffer): no
    step hooks (its own or global ones) and no `step` replaced on the instance (but an LR
    scheduler's counting wrapper), none of them fused (the fused kernel leaves the version
    counters as they were), Nesterov or differentiable, weight decay only with momentum (where
    it is in the buffer), and every one of `flat` in a group. None otherwise: θ is copied."""
    if type(optimizer) is not torch.optim.SGD:
        return None
    if (
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _optim._global_optimizer_pre_hooks
        or _optim._global_optimizer_post_hooks
    ):
        return None
    step = vars(optimizer).get("step")
    if step is not None and not getattr(step, "_wrapped_by_lr_sched", False):
        return None
    group_of: dict[int, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        if (
            group.get("fused")
            or group.get("nesterov")
            or group.get("differentiable")
            or (not group["momentum"] and group["weight_decay"])
        ):
            return None
        for p in group["params"]:
            group_of[id(p)] = group
    groups = [group_of.get(id(q)) for q in flat]
    return None if None in groups else groups  # type: ignore[return-value]


class Audit:
    """Watches the nodes of a graph and says what it saw. Built by the Trainer when
    `auditing=` is given; little reason to make one by hand except to choose a cadence or to
    declare groups, the channel partitions a node keeps apart::

        Trainer(g, ..., auditing=Audit(every=10, channels=True))
        Audit(groups={"encoder": {"audio": range(0, 64), "text": range(64, 128)}})

    `every`: measure one step in this many. `snapshot`: the costlier numbers (effective rank,
    update stable rank, ‖∂L/∂output‖) every this many steps. `window`: the steps zero and
    saturated fractions and dead channels are taken over. `inside`: also watch what is in each
    node — True for every leaf module, an int for modules down to that depth, or a list of
    places (`"node.path"`); at most `most` per node. Refuses a cadence under 1 and groups that
    are not channel indices.
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
        for name, value in (("every", every), ("snapshot", snapshot), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Audit({name}=...) is a whole number of steps ≥ 1, not {value!r}")
        if not isinstance(most, int) or most < 1:
            raise ValueError(f"Audit(most=...) is a number of places ≥ 1, not {most!r}")
        self.every = every
        self.snapshot = snapshot
        self.channels = bool(channels)
        self.window = window
        self.inside = inside
        self.most = most
        self.groups: dict[str, dict[str, list[int]]] = {}
        for where, parts in (groups or {}).items():
            if not isinstance(parts, Mapping) or len(parts) < 2:
                raise ValueError(
                    f"groups[{where!r}] names at least two channel groups, "
                    f"e.g. {{'audio': range(0, 64), 'text': range(64, 128)}}"
                )
            self.groups[where] = {k: [int(i) for i in v] for k, v in parts.items()}
        self.step = 0
        self._bucket = -1  # the last `snapshot` steps a snapshot was taken in
        self._graph: Any = None
        self._places: dict[str, _Place] = {}
        self._handles: list[Any] = []
        self._inner_hooks: list[tuple[nn.Module, Any]] = []
        self._tap: Tap | None = None
        self._measuring = False
        self._features = False
        self._outward = False  # this step keeps ∂L/∂output (a snapshot step)
        self._flat: list[nn.Parameter] = []
        # θ as a measured step found it, for the update the optimizer then makes from it
        # (`moved`); `_copied` while that copy waits for the update, and the numbers of the
        # measured steps waiting with it (several under gradient accumulation)
        self._prev: list[torch.Tensor] | None = None
        self._copied = False
        self._waiting: list[tuple[bool, list[tuple[_Place, dict[str, Any]]]]] = []
        self._moving: list[tuple[_Place, dict[str, Any]]] = []  # this step's, as measured
        # the optimizer whose step `moved` will hear of (the Trainer sets it each step; None by
        # hand): when it is torch's SGD, the update is read from that step (`_read_step`;
        # `_terms`, the SGD param group of each parameter, while it waits), not from a copy of
        # θ; `_readable` until a step moved the weights otherwise; `_heard`: each gradient as
        # the measured step found it, with its version and ‖g‖²
        self._optimizer: Any = None
        self._terms: list[dict[str, Any]] | None = None
        self._readable = True
        self._heard: dict[int, tuple[torch.Tensor, int, float]] = {}
        self._versions: list[int] = []  # the parameters' version counters at the copy
        # the parameters something has moved at some update: one of them untouched by an update
        # is waiting for its own (a node trained by a Learning with its own `every`)
        self._movers: set[int] = set()
        # ‖θ‖² as the last measured step took it, and which weights had moved since the copy
        self._was: list[float] | None = None
        self._stale: set[int] = set()
        self._began = False  # this measured step has taken (or kept) its copy
        # numpy views of the parameters and of the copy of θ_{t−1} (CPU float tensors only),
        # and the parameters' data pointers they were made for
        self._views: list[np.ndarray] | None = None
        self._prev_views: list[np.ndarray] | None = None
        self._ptrs: list[int] = []
        self._order: list[_Place] = []
        # this measured step's outputs so far, by id (with a weak reference, so that an id
        # reused by another tensor is told apart, and nothing is kept alive by it: with
        # micro-batches a step has several forwards), and the places that saw one again
        self._seen: dict[int, tuple[weakref.ref, _Place, int]] = {}
        self._twins: list[tuple[_Place, _Place]] = []
        self._sums: list[torch.Tensor | None] = []  # None: one of `_later`'s, not yet taken
        self._later: list[_Place] = []  # places whose sums wait for `observed`

    def __repr__(self) -> str:
        watching = f", watching {len(self._places)} places" if self._graph is not None else ""
        return f"Audit(every={self.every}, step={self.step}{watching})"

    # -- which places ---------------------------------------------------------------------
    def _inner(self, node: str, held: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        inside = self.inside
        if inside is None or inside is False:
            return []
        named = inside if isinstance(inside, (bool, int)) else set(inside)
        found: list[tuple[str, nn.Module]] = []
        for name, module in held:
            for path, m in module.named_modules():
                full = join(name, path)
                if not full:
                    continue
                if inside is True:
                    keep = next(m.children(), None) is None
                elif isinstance(inside, int):
                    keep = full.count(".") < inside
                else:
                    keep = f"{node}.{full}" in named
                if keep:
                    found.append((f"{node}.{full}", m))
        return found[: self.most]

    def watch(self, graph: Any) -> Audit:
        """Hooks every node of this graph, and — with `inside=` — what is in it.

        What comes back is keyed by node, and by `node.path.to.submodule` for anything inside
        one. Refuses a second graph before `release()`, and groups or places that name
        nothing there.
        """
        if self._graph is not None:
            raise RuntimeError("this Audit already watches a graph: release() it first")
        g = as_graph(graph)
        places: dict[str, _Place] = {}
        inner: list[tuple[nn.Module, Any]] = []
        for node in g.nodes():
            held = named_modules_of(g.implementation(node))
            places[node] = _Place(node, [m for _, m in held], self.window)
            for where, m in self._inner(node, held):
                places[where] = _Place(where, [m], self.window)
                inner.append((m, self._hook(where)))
        if not isinstance(self.inside, (type(None), bool, int)):
            missing = sorted(set(self.inside) - set(places))
            if missing:
                raise ValueError(f"Audit(inside=...) names {missing}, which are not in this graph")
        missing = sorted(set(self.groups) - set(places))
        if missing:
            raise ValueError(
                f"Audit(groups=...) names {missing}; the places are {sorted(places)[:12]}"
            )
        for where, parts in self.groups.items():
            places[where].groups = parts
        # every place's parameters in one flat list (a parameter of `layer.l` is also one of
        # `layer`'s), so a measured step takes all the norms in one `_foreach_norm`
        flat: list[nn.Parameter] = []
        slot: dict[int, int] = {}
        for place in places.values():
            for q in place.params:
                if id(q) not in slot:
                    slot[id(q)] = len(flat)
                    flat.append(q)
            place.index = [slot[id(q)] for q in place.params]
        self._flat = flat
        self._prev = None
        self._readable = True
        self._copied = False
        self._movers = set()
        self._waiting = []
        self._terms = None
        self._heard = {}
        self._views = self._prev_views = None
        self._ptrs = []
        self._places = places
        self._order = list(places.values())
        self._inner_hooks = inner
        self._graph = g
        self._tap = Tap(g, self._node).on()
        self._arm(self.step % self.every == 0)
        return self

    def _arm(self, measuring: bool) -> None:
        """Forward hooks inside nodes are there only for a step that is measured: a module
        with no hooks takes torch's fast path, so unmeasured steps pay nothing for them."""
        self._measuring = measuring
        if self._tap is not None:
            self._tap.live = measuring
        self._began = False
        snapshot = measuring and self._snapshot_now()
        self._outward = snapshot
        self._features = snapshot or (measuring and self.channels)
        if measuring and not self._handles:
            self._handles = [m.register_forward_hook(h) for m, h in self._inner_hooks]
        elif not measuring and self._handles:
            self._drop(self._handles)
            self._handles = []

    @staticmethod
    def _drop(handles: list[Any]) -> None:
        for h in handles:
            h.remove()

    def release(self) -> None:
        """Takes the hooks off. A hook nobody removed is a graph nobody can garbage-collect,
        and a second watch would double every count."""
        self._drop(self._handles)
        self._handles = []
        self._inner_hooks = []
        if self._tap is not None:
            self._tap.off()
            self._tap = None
        self._graph = None
        self._optimizer = None
        self._prev = None
        self._copied = False
        self._waiting = []
        self._terms = None
        self._heard = {}
        self._views = self._prev_views = None
        self._ptrs = []
        self._sums = []
        self._later = []
        self._seen.clear()
        self._twins = []

    # -- forward: what came out -----------------------------------------------------------
    def _node(self, node: str, input: Any, ctx: Any, out: Any) -> None:
        if self._measuring:
            place = self._places.get(node)
            if place is not None:
                self._saw(place, out)

    def _hook(self, where: str) -> Any:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if self._measuring:
                self._saw(self._places[where], out)

        return hook

    def _saw(self, place: _Place, out: Any) -> None:
        """Sums of what came out, left as tensors: `observed` reads them all at once."""
        if not self._began:
            self._begin()
        if type(out) is torch.Tensor:
            t = out
        else:
            t = next((x for x in tensors_in(out) if x.is_floating_point()), None)
            if t is None:
                return
        dtype = t.dtype
        widen = dtype is not torch.float32 and dtype is not torch.float64
        if widen and not dtype.is_floating_point:
            return
        version = t._version
        # the same output seen again, unchanged (a node's output is often its last layer's, and
        # `inside=` watches both): its sums, ∂L/∂output and channel view are the first place's
        seen = self._seen.get(id(t))
        if seen is not None:
            same, first, then = seen
            if same() is t and then == version and first.saturates == place.saturates:
                place.at, place.size, place.kept = first.at, first.size, first.kept
                place.out_grad = None
                self._twins.append((place, first))
                if self._features or place.groups is not None:
                    place.features = channel_view(first.kept, place.conv)
                return
        self._seen[id(t)] = (weakref.ref(t), place, version)
        a = t.detach()
        if widen:
            a = a.float()  # a count summed in half precision is not a count
        sums = self._sums
        place.at = len(sums)
        place.size = a.numel() or 1
        place.kept = a  # read again only if its sum is not finite (which nan, which inf)
        place.seen = a._version
        if place.later and a.is_cpu and a.is_contiguous():
            # nothing writes over it before `observed`: its sums are taken there, in numpy with
            # the norms (`_read_sums`); these are their places in the list
            self._later.append(place)
            sums += (None, None, None) if place.saturates is not None else (None, None)
        else:
            sums.append(a.sum())
            magnitude = a.abs()
            if place.saturates == "sigmoid":
                sums.append(((a <= _LOW) | (a >= _HIGH)).sum())
            elif place.saturates == "tanh":
                sums.append((magnitude >= _HIGH).sum())
            # |a| ≤ ε as 1.0 / 0.0 in the buffer just made (a float sum is cheaper than a bool)
            sums.append(magnitude.le_(_DEAD_EPS).sum())
        if self._outward and t.requires_grad:
            place.out_grad = None
            retain = place.retain
            if retain is not False and t.grad_fn is not None and not t.retains_grad:
                t.retain_grad()
                place.held = t
                place.version = t._version
            else:
                retain = False
            if not retain:
                t.register_hook(place.hear)
        if self._features or place.groups is not None:
            place.features = channel_view(a, place.conv)

    @staticmethod
    def _retained(place: _Place) -> None:
        """∂L/∂output from the output's retained grad, if that is still the output's: an
        output modified in place after the place saw it has the grad of what it became."""
        t = place.held
        place.held = None
        untouched = t._version == place.version
        if place.retain is None:  # hooked too this time: keep the hook's, and learn
            place.retain = untouched
        elif untouched:
            place.out_grad = t.grad
        else:  # cannot be told this step; hooked from now on
            place.retain = False
        t.grad = None

    def _snapshot_now(self) -> bool:
        """Whether this step is the first measured one of its `snapshot` steps (0–49, 50–99,
        …): every `snapshot` steps whatever `every` is (at every=7, steps 0, 56, 105, …;
        a step count that had to divide both would make them 350 apart)."""
        return self.step // self.snapshot != self._bucket

    # -- after backward: the step's numbers ------------------------------------------------
    def observed(self, graph: Any = None) -> list[dict[str, Any]]:
        """One health fact per node, for the step that just finished.

        Called after backward (and before the optimizer steps), the only moment when this
        step's activations and the gradients for them are both in hand. Empty on an unmeasured
        step. Refused before `watch`.
        """
        if self._graph is None:
            raise RuntimeError("observed() before watch(graph): nothing is being watched")
        step = self.step
        every = self.every
        phase = step % every
        if phase:  # not measured
            self.step = step + 1
            if phase == every - 1:
                self._arm(True)
            return []
        snapshot = self._snapshot_now()
        if snapshot:
            self._bucket = step // self.snapshot
        facts = self._measure(step, snapshot)
        self._sums = []
        if not self._began:  # nothing was heard in the forward (no local node ran)
            self._begin()
        if self._copied:
            self._waiting.append((snapshot, self._moving))
        self._moving = []
        self.step = step + 1
        self._arm(self.step % every == 0)
        return facts

    def _begin(self) -> None:
        """The first thing a measured step does, at the first output heard: θ as the step
        finds it is copied (before backward, so that a node trained inside backward by its own
        `Learning` is seen to move too), kept until `moved`. A copy still waiting is kept while
        the parameters have not moved (gradient accumulation: the group's steps share one
        update); if they moved and nobody said so (`moved` is only called by the Trainer),
        the update is taken now, for the facts that waited for it."""
        self._began = True
        flat = self._flat
        if not flat:
            return
        if self._copied:
            if [q._version for q in flat] == self._versions:
                return
            self.moved()
        self._copy()

    def _copy(self) -> None:
        """θ into buffers made once (made again if a parameter's memory moved: `_views_now`
        tells); or nothing, when the update will be read from the Trainer's SGD step itself
        (`_read_step`): then only the version counters are kept, to tell that step was the
        only thing that moved the weights."""
        if self._optimizer is not None and self._readable:
            self._terms = _sgd_groups(self._optimizer, self._flat)
            if self._terms is not None:
                self._copied = True
                self._versions = [q._version for q in self._flat]
                return
        self._views_now()
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self._prev is None:
                self._prev = [q.detach().clone() for q in self._flat]
                self._prev_views = None
            elif self._prev_views is not None and self._views is not None:
                # on the CPU, numpy views: 34 µs a measured step in situ, against 40 for
                # torch's _foreach_copy_
                for into, value in zip(self._prev_views, self._views, strict=True):
                    into[...] = value
            else:
                torch._foreach_copy_(self._prev, self._flat)
        finally:
            torch._C._set_grad_enabled(enabled)
        self._copied = True
        self._versions = [q._version for q in self._flat]

    def moved(self) -> None:
        """Tells the audit the optimizer has stepped: the last measured step's facts get
        `update_ratio` (‖θ_after − θ‖/‖θ‖, θ the weights that step ran with) and, on a
        snapshot step, `update_stable_rank` of that update, filled into the facts `observed`
        gave back. The Trainer calls it after each update (and holds a measured step's facts
        until then); by hand, call it after `optimizer.step()`. Under gradient accumulation
        every measured step of the group gets the group's update; a place whose weights this
        update left untouched, where something has moved them before (a node trained by its
        own `Split(every=k)`), gets no ratio that step rather than a 0 that reads as STALLED.
        Nothing to do, and nothing done, when no measured step waits for an update. Under the
        Trainer's torch SGD the update is read from that step (`_read_step`) instead of a
        copy of θ; a step in which the weights moved otherwise gives no ratio, and θ is copied
        from then on."""
        if not self._copied:
            return
        self._copied = False
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        flat = self._flat
        known, stale = self._was, self._stale
        self._was = None
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self._terms is not None:
                # the update read from the SGD step itself: ‖Δθ‖² and what Δθ is a multiple of
                read_off = self._read_step(known, stale)
                self._terms = None
                if read_off is None:  # moved otherwise than by that one step: no ratio, this
                    self._readable = False  # once, and θ is copied from the next measured step
                    return
                was = known
                square, of, frob = read_off
            else:
                was, square = self._subtracted(known, stale)
                of, frob = self._prev, square  # prev is now −Δθ
            # a snapshot step's update stable rank is taken on Δθ (or on what it is a multiple
            # of: the ratio does not see the scale)
            tops: dict[int, float] = {}
            if any(snap for snap, _ in waiting):
                bigs = sorted({b for snap, got in waiting if snap for b in self._bigs(got)})
                if bigs:
                    found = spectra([], [of[b] for b in bigs])[1]  # type: ignore[index,misc]
                    tops = dict(zip(bigs, found, strict=True))
        finally:
            torch._C._set_grad_enabled(enabled)
        # a place whose weights this update left untouched (their version counters say so), and
        # that something has moved before, is waiting for an update of its own: no ratio yet
        # (a 0 would read as STALLED); one never moved at all reads 0, and is STALLED
        versions = self._versions
        now = [q._version for q in flat]
        movers = self._movers
        if now == versions:  # nothing moved
            waits = set(movers)
        else:
            untouched = {i for i, v in enumerate(now) if v == versions[i]}
            waits = untouched & movers
            if len(movers) < len(now):
                movers.update(i for i in range(len(now)) if i not in untouched)
        sqrt = math.sqrt
        for snap, got in waiting:
            for place, n in got:
                index = place.index
                if waits and waits.issuperset(index):
                    continue
                delta = sqrt(sum([square[i] for i in index]))
                norm = sqrt(sum([was[i] for i in index]))
                n["update_ratio"] = delta / norm if norm > 0 else 0.0
                if snap:
                    big = self._big(place)
                    if big is not None:
                        n["update_stable_rank"] = stable_of(sqrt(frob[big]), tops[big])

    def _subtracted(
        self, known: list[float] | None, stale: set[int]
    ) -> tuple[list[float], list[float]]:
        """‖θ‖² and ‖θ' − θ‖² of each parameter from the copy of θ, which is left holding
        θ − θ' = −Δθ. ‖θ‖² as the step measured it (`known`), unless the weight had moved by
        then (`stale`: a node trained inside backward), or it was not measured after the copy:
        then from the copy."""
        flat, prev = self._flat, self._prev
        assert prev is not None
        views = self._views_now()
        if views is not None and self._prev_views is None:
            self._prev_views = numpy_views(prev)
        pviews = self._prev_views if views is not None else None
        if pviews is not None:  # on the CPU: a subtraction and a BLAS dot a tensor
            dot = np.vdot  # (numpy's `dot` warns on an overflow since 2.4; `vdot` does not)
            if known is None or stale:
                was = [
                    float(dot(d, d)) if known is None or i in stale else known[i]
                    for i, d in enumerate(pviews)
                ]
            else:
                was = known
            # (a third of what one torch _foreach_sub_ costs). With every weight of the copy
            # finite (‖θ‖² says so), θ − θ' sets no floating-point flag: inf and NaN in θ'
            # go through quietly, and |θ| < 2e19 is far under half an ulp of the largest
            # float, so no finite difference rounds to inf. Only a copy that is not finite
            # needs np.errstate (≈ 10 µs cold), for its inf − inf
            subtract = np.subtract
            quiet = _AS_IS if math.isfinite(math.fsum(was)) else np.errstate(all="ignore")
            with quiet:  # (for a copy that is not finite: a nan to report, and no warning)
                for d, v in zip(pviews, views, strict=True):  # type: ignore[arg-type]
                    subtract(d, v, out=d)
            return was, [float(dot(d, d)) for d in pviews]
        if known is None or stale:
            before = list(torch._foreach_norm(prev))
            torch._foreach_sub_(prev, flat)
            got = read(before + list(torch._foreach_norm(prev)))
            return [v * v for v in got[: len(prev)]], [v * v for v in got[len(prev) :]]
        torch._foreach_sub_(prev, flat)
        return known, [v * v for v in read(list(torch._foreach_norm(prev)))]

    def _read_step(
        self, known: list[float] | None, stale: set[int]
    ) -> tuple[list[float], list[Any], list[float]] | None:
        """The update the Trainer's SGD step just made, read from its own terms instead of a
        copy of θ: torch's SGD moves each weight by −lr·g without momentum (and without weight
        decay), and by −lr·buf with it (buf its momentum buffer after the step, weight decay
        and dampening already in it), so ‖Δθ‖ is lr·‖g‖ or lr·‖buf‖, up to the float
        rounding of θ − lr·g (≈ 10⁻⁷ of each weight). Answers ‖Δθ‖², the tensor each Δθ is a
        multiple of and its ‖·‖²; None when a weight moved otherwise than by exactly
        that one step (its version counter says so: before the step, or more than once), or
        ‖θ‖² was not measured after the step began."""
        heard, self._heard = self._heard, {}
        if known is None or stale:
            return None
        flat, groups = self._flat, self._terms
        assert groups is not None
        state = self._optimizer.state  # type: ignore[union-attr]
        of: list[Any] = [None] * len(flat)
        frob = [0.0] * len(flat)
        unknown: list[int] = []  # whose ‖·‖² is still to take
        for i, (q, group, then) in enumerate(zip(flat, groups, self._versions, strict=True)):
            grad = q.grad
            if q._version - then != (grad is not None):  # one step moves it once, or not at all
                return None
            if grad is None:
                continue
            if group["momentum"]:
                of[i] = state.get(q, {}).get("momentum_buffer")
                if of[i] is None:
                    return None
                unknown.append(i)
                continue
            of[i] = grad
            was_heard = heard.get(i)  # ‖g‖² as the step measured it, if g is still that
            if was_heard is not None and was_heard[0] is grad and was_heard[1] == grad._version:
                frob[i] = was_heard[2]
            else:
                unknown.append(i)
        if unknown:
            for i, size in zip(unknown, squares_of([of[i] for i in unknown]), strict=True):
                frob[i] = size
        lrs = [float(group["lr"]) for group in groups]
        return [lr * lr * size for lr, size in zip(lrs, frob, strict=True)], of, frob

    def _big(self, place: _Place) -> int | None:
        """The place's largest weight (by where it sits among the flat parameters), if it is a
        matrix or more: what its update stable rank is taken on."""
        flat = self._flat
        big = max(place.index, key=lambda k: flat[k].numel())
        return big if flat[big].dim() >= 2 else None

    def _bigs(self, got: list[tuple[_Place, dict[str, Any]]]) -> list[int]:
        return [b for b in (self._big(p) for p, _ in got) if b is not None]

    def _measure(self, step: int, snapshot: bool) -> list[dict[str, Any]]:
        """Every place's numbers for this step, from one pass of norms and one read."""
        flat = self._flat
        places = self._order
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() costs µs a step here
        try:
            grads = [q.grad for q in flat]
            whole = all(g is not None for g in grads)
            if not whole:
                grad_at = {
                    i: k for k, i in enumerate(i for i, g in enumerate(grads) if g is not None)
                }
                grads = [g for g in grads if g is not None]
            for p in places:
                if p.held is not None:
                    self._retained(p)
            later, lost = self._written_over()
            for p, first in self._twins:
                p.out_grad = first.out_grad
                if lost and first.at in lost:
                    p.features = None
            self._twins = []
            self._seen.clear()
            outs = [p.out_grad for p in places if p.out_grad is not None]
            views = self._views_now()
            if views is not None:
                square, sums = self._squares_numpy(views, grads, outs, later)
            else:
                square, sums = self._squares_torch(flat, grads, outs, later)
            extra: dict[int, dict[str, Any]] = {}
            if snapshot:
                self._snapshot(places, extra)
        finally:
            torch._C._set_grad_enabled(enabled)
        at_grad = len(flat)
        at_out = at_grad + len(grads)
        if self._copied:  # ‖θ‖² for the update ratio, where the weights are still the copy's
            versions = self._versions
            self._was = square[:at_grad]
            if self._terms is not None:  # and ‖g‖², which a plain SGD step's update is lr times
                self._heard = (
                    {i: (g, g._version, square[at_grad + i]) for i, g in enumerate(grads)}
                    if whole
                    else {
                        i: (grads[k], grads[k]._version, square[at_grad + k])
                        for i, k in grad_at.items()
                    }
                )
            now = [q._version for q in flat]
            self._stale = (
                set() if now == versions else {i for i, v in enumerate(now) if v != versions[i]}
            )
        moving = self._moving
        isnan, isinf, isfinite, sqrt = math.isnan, math.isinf, math.isfinite, math.sqrt
        shared: dict[tuple, Any] = {}  # channel activity, once per output
        facts = []
        out_k = at_out
        for pi, place in enumerate(places):
            n: dict[str, Any] = {}
            nan = inf = False
            index = place.index
            if index:
                n["param_norm"] = sqrt(sum([square[i] for i in index]))
                if whole:
                    g = sqrt(sum([square[at_grad + i] for i in index]))
                else:
                    mine = [square[at_grad + grad_at[i]] for i in index if i in grad_at]
                    g = sqrt(sum(mine)) if mine else None
                if g is not None:
                    n["grad_norm"] = g
                    n["nan"] = nan = isnan(g)
                    n["inf"] = inf = isinf(g)
                moving.append((place, n))  # update_ratio: when the optimizer has moved
            k = place.at
            if k >= 0 and not (lost and k in lost):
                size = place.size
                total = sums[k]
                n["act_mean"] = total / size
                peak = 0.0  # a place that does not saturate (nothing sigmoid- or tanh-like last)
                if place.saturates is not None:
                    saturated = place.saturated
                    saturated.append(sums[k + 1] / size)
                    peak = max(saturated)
                    k += 1
                zero = place.zero
                zero.append(sums[k + 1] / size)
                n["zero"] = max(zero)
                n["saturated"] = peak
                if not isfinite(total):  # which one, as Σ|a| tells it
                    whole_sum = float(place.kept.abs().sum())
                    nan, inf = nan or isnan(whole_sum), inf or isinf(whole_sum)
                n["nan"] = nan
                n["inf"] = inf
                if place.out_grad is not None:
                    n["out_grad_norm"] = sqrt(square[out_k])
                    out_k += 1
            if snapshot:
                n.update(extra[pi])
            if k >= 0:
                if place.later is None:  # the first measured step: was it written over?
                    place.later = place.kept is not None and place.kept._version == place.seen
                if place.features is not None:
                    with torch.no_grad():
                        if self.channels:
                            self._channels(place, place.features, n, shared)
                        if place.groups:
                            n["cka"] = self._groups(place, place.features)
                place.at = -1
                place.out_grad = place.features = place.kept = None
            if n:
                facts.append({"fact": "health", "where": place.where, "step": step, "numbers": n})
        return facts

    def _views_now(self) -> list[np.ndarray] | None:
        """numpy views of the watched parameters, when all are dense float32/float64 CPU
        tensors (None otherwise): made once, and again only when a parameter's memory moved
        (a `.to(device)`, a `p.data = ...`); `q.data_ptr()` is what tells. Then the buffers
        θ is copied into are made again too, at the next copy (not while a copy waits for its
        update: its values are still θ's)."""
        ptrs = [q.data_ptr() for q in self._flat]
        if ptrs != self._ptrs:
            self._ptrs = ptrs
            self._views = numpy_views([q.detach() for q in self._flat])
            self._prev_views = None  # made again by `moved` when it needs them
            if not self._copied:
                self._prev = None
        return self._views

    def _written_over(self) -> tuple[list[_Place], set[int]]:
        """The places whose sums wait for `observed`, less those whose output was written over
        in place after all (its numbers for this step are lost: where its sums start, in
        `lost`); those take their sums at once from now on."""
        later, self._later = self._later, []
        lost: set[int] = set()
        if later:
            kept = []
            for p in later:
                if p.kept._version == p.seen:  # type: ignore[union-attr]
                    kept.append(p)
                else:
                    lost.add(p.at)
                    p.later = False
                    p.features = None
            later = kept
        return later, lost

    def _squares_numpy(
        self,
        views: list[np.ndarray],
        grads: list[torch.Tensor],
        outs: list[torch.Tensor],
        later: list[_Place],
    ) -> tuple[list[float], list[Any]]:
        """`_squares_torch`'s numbers on the CPU: one BLAS dot per tensor through numpy (a
        third of a torch call's cost at these sizes, and no tensor to read back)."""
        dot = np.vdot  # an overflow is an inf to report: numpy's `dot` would warn, `vdot` not
        square = [float(dot(v, v)) for v in views]
        square += [square_of(t) for t in grads]
        square += [square_of(t) for t in outs]
        return square, self._read_sums(later)

    def _squares_torch(
        self,
        flat: list[torch.Tensor],
        grads: list[torch.Tensor],
        outs: list[torch.Tensor],
        later: list[_Place],
    ) -> tuple[list[float], list[Any]]:
        """‖·‖² of the parameters, their grads and the outputs' grads, in that order; and the
        outputs' sums. One `_foreach_norm` and one read (one synchronisation on a GPU)."""
        tensors: list[torch.Tensor] = [*flat, *map(dense, grads), *outs]
        numbers = list(torch._foreach_norm(tensors)) if tensors else []
        if not later:
            at_sums = len(numbers)
            values = read(numbers + self._sums)  # type: ignore[operator]
            return [v * v for v in values[:at_sums]], values[at_sums:]
        return [v * v for v in read(numbers)], self._read_sums(later)

    def _read_sums(self, later: list[_Place]) -> list[Any]:
        """The outputs' sums as numbers: those left as tensors in the forward read at once,
        and those of `later` taken now (`later_sums`)."""
        sums = self._sums
        if not later:
            return read(sums)  # type: ignore[arg-type]
        numbers = iter(read([t for t in sums if t is not None]))  # type: ignore[misc]
        values: list[Any] = [None if t is None else next(numbers) for t in sums]
        for p in later:
            later_sums(p.kept.numpy().reshape(-1), p.saturates, values, p.at)  # type: ignore[union-attr]
        return values

    def _snapshot(self, places: Iterable[_Place], extra: dict[int, dict[str, Any]]) -> None:
        """The effective rank and rank room of each place's output, into `extra[place]` (the
        update stable rank comes with the update, in `moved`). A place and what is inside it
        often share an output (`layer`, `layer.r`): it is taken once."""
        features: list[torch.Tensor] = []
        feature_of: dict[tuple[int, bool], int] = {}
        ranked: list[tuple[int, int]] = []
        for i, place in enumerate(places):
            extra[i] = {}
            rows = self._rows(place)
            if rows is not None:
                key = (id(place.kept), place.conv)
                k = feature_of.get(key)
                if k is None:
                    feature_of[key] = k = len(features)
                    features.append(rows)
                ranked.append((i, k))
        ranks = spectra(features, [])[0]
        for i, k in ranked:
            extra[i]["effective_rank"] = ranks[k]
            extra[i]["rank_room"] = min(features[k].shape)

    @staticmethod
    def _rows(place: _Place) -> torch.Tensor | None:
        """What the effective rank of a place is taken on: its output's first `_ROWS` rows."""
        f = place.features
        if place.at < 0 or f is None or f.shape[0] <= 1:
            return None
        rows = f if f.dim() == 2 else f.reshape(f.shape[0], -1)
        return rows[:_ROWS] if rows.shape[0] > _ROWS else rows

    def _channels(
        self, place: _Place, f: torch.Tensor, n: dict[str, Any], shared: dict[tuple, Any]
    ) -> None:
        key = (id(place.kept), place.conv)
        activity = shared.get(key)
        if activity is None:
            activity = shared[key] = f.abs().mean(0)
        place.alive.append(activity > _DEAD_EPS)
        alive = torch.stack(list(place.alive)).any(0)
        n["channels"] = int(activity.numel())
        n["dead_channels"] = int((~alive).sum())
        mean = float(activity.mean())
        n["dormant_channels"] = int((activity <= _DORMANT_TAU * mean).sum()) if mean > 0 else 0

    def _groups(self, place: _Place, f: torch.Tensor) -> float:
        rows = f[:: max(1, f.shape[0] // _ROWS)].double()
        width = rows.shape[1]
        parts = list(place.groups.items())
        best = 0.0
        for i in range(len(parts)):
            for j in range(i + 1, len(parts)):
                a, b = parts[i][1], parts[j][1]
                if max(a + b) >= width:
                    raise ValueError(
                        f"groups[{place.where!r}] names channel {max(a + b)}, and that place "
                        f"has {width} channels"
                    )
                best = max(best, cka(rows[:, a], rows[:, b]))
        return best if math.isfinite(best) else 0.0
