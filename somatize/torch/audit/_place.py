"""One place an `Audit` watches: what it holds, what it hears in a measured step's forward and
backward (left as tensors), and the numbers it makes of them once they are read."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from somatize._channels import channels_first
from somatize.run import warn
from somatize.torch._modules import join, parts_of, tensors_in
from somatize.torch.audit._measures import (
    _DEAD_EPS,
    _DORMANT_TAU,
    activity,
    cka,
    effective_rank,
    floats_in,
    norm,
    output_of,
    rows_of,
    sums_of,
)
from somatize.torch.inside.kinds import kind_of, label_of

_LOOKING = contextvars.ContextVar("looking", default=False)


def hearing() -> bool:
    """Whether an Audit hears a forward run now: in grad mode (an evaluation between steps
    under no_grad is not a step), and not a look's (`looking`)."""
    return torch.is_grad_enabled() and not _LOOKING.get()


@contextlib.contextmanager
def looking() -> Iterator[None]:
    """What a look (probe, proxies) runs in, whatever the cell's settings: heard by no Audit,
    with grad mode on and inference mode and anomaly detection off (which would raise at the
    NaN a look is there to find). An audit stays armed between a Trainer's steps for the next
    measured one, and a look run then through the same modules is not that step's: heard, it
    took θ's copy while synflow held |θ| in its place."""
    token = _LOOKING.set(True)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            with torch.autograd.set_detect_anomaly(False):
                yield
    finally:
        _LOOKING.reset(token)


def saturation(module: nn.Module | None) -> str | None:
    """How a place holding `module` saturates, read off its last leaf module (in the order
    they were declared, which is the order most forwards apply them): "sigmoid" (flat near 0
    and 1) or "tanh" (flat near ±1) when that is such an activation, else None."""
    if module is None:
        return None
    while parts := parts_of(module):  # its last part's last leaf
        module = parts[-1][1]
    if kind_of(module) != "activation":
        return None
    names = [c.__name__ for c in type(module).__mro__]
    if any("Sigmoid" in n for n in names):
        return "sigmoid"
    return "tanh" if any(n in ("Tanh", "Hardtanh", "Softsign") for n in names) else None


def layouts(modules: list[nn.Module]) -> dict[int, bool]:
    """Whether each of `modules`, and each module in them, gives a 3-d output with its
    channels first, (N, C, L), by id: as `somatize._channels.channels_first` answers, what
    came before a module being the one declared before it (the order most forwards apply
    them; what a forward does between modules is not seen), and a block's its last layer's."""
    out: dict[int, bool] = {}
    first = False

    def visit(m: nn.Module) -> None:
        nonlocal first
        parts = parts_of(m)
        for _, part in parts:
            visit(part)
        if not parts:
            first = channels_first(kind_of(m), label_of(m), first)
        out[id(m)] = first

    for m in modules:
        visit(m)
    return out


class Place:
    """A node (`inside` None) or a module inside one (`inside` its dotted path under the
    node). `module`: the one hooked, a node's the `Holder` it is called through; `weights`:
    what it holds, each once, and `params` those it trains (that ask for a gradient); `index`:
    where they sit in the audit's flat list of weights; `first`: its 3-d outputs hold their
    channels first."""

    def __init__(self, node: str, inside: str | None, module: nn.Module, window: int, first: bool):
        self.node = node
        self.inside = inside
        self.where = node if inside is None else f"{node}.{inside}"
        self.module = module
        self.weights = list(module.parameters())  # (each once)
        self.params: list[nn.Parameter] = []  # those it trains (`Audit._weigh`)
        self.saturates = saturation(module)
        self.width = 2 if self.saturates is None else 3  # Σ|a|, zeros (and saturated), per call
        self.first = first
        self.index: list[int] = []
        self.big = -1  # where its largest weight sits in that list, if it is a matrix or more
        self.groups: dict[str, list[int]] | None = None
        # across measured steps
        self.zero: deque[float] = deque(maxlen=window)
        self.saturated: deque[float] = deque(maxlen=window)
        self.alive: deque[torch.Tensor] = deque(maxlen=window)
        self.norms: deque[tuple[int, float]] = deque(maxlen=window)
        self.has_moved = False  # some update has moved its weights
        # weights all zero when first weighed (LoRA's B) are only their updates at first, ‖θ‖
        # about k‖Δθ‖ after k of them: measured steps left before they have a size of their
        # own (None: not weighed yet), and the last step whose update_ratio is left out for it
        self.growing: int | None = None
        self.grown_after = -1
        self.run = -1  # the forward of its node it was last heard in (`Audit._fresh`)
        self.inherited: bool | None = None  # its NaN/inf came from elsewhere (None: finite)
        self.share: float | None = None  # effective rank / its room, at its first snapshot
        self.step = -1  # the measured step its tensor hooks belong to
        self.clear()

    def clear(self) -> None:
        """Forget this step's tensors (once `numbers` has made numbers of them)."""
        self.sums: list[torch.Tensor] = []  # `width` one-number tensors per call
        self.size = 0
        self.heard: list[int] = []  # when each call was heard, counted over every place's
        self.ins: set[int] = set()  # the calls that made what it was given (-1: none did)
        self.out_grads: list[torch.Tensor] = []  # ‖∂L/∂output‖ per call, from a tensor hook
        self.activity: list[torch.Tensor] = []  # per-channel mean |a|, per call
        self.in_grads: list[torch.Tensor] = []  # per-channel mean |∂L/∂input|, per call
        self.rows: torch.Tensor | None = None
        self._at = 0

    # -- in the forward, and the backward ---------------------------------------------------
    def saw(self, input: Any, out: Any, step: int, channels: bool, snapshot: bool) -> None:
        """What came out of the place on a measured step (and the ids of what went in), left as
        tensors, and tensor hooks for the gradients that will come back."""
        t = output_of(tensors_in(out))
        if t is None:
            return
        a = t.detach()
        if (snapshot or self.groups is not None) and self.rows is None:
            rows = rows_of(a, self.first)
            if self.groups is not None and rows is not None:
                self._fits(rows.shape[1])  # before this place keeps anything of the step
            self.rows = rows
        self.step = step
        self.sums += sums_of(a, self.saturates)
        self.size += a.numel()
        self.ins.update(map(_maker, floats_in(input)))  # (before its own output is known)
        self.heard.append(h := next(_HEARD))
        _made(t, h)
        # (a hook holds the place by a weak reference: held, it would keep the weights alive)
        if snapshot and t.requires_grad:
            t.register_hook(_hear(weakref.ref(self), step, "out_grads", None))
        if channels:
            self.activity.append(activity(a, self.first))

    def given(self, input: Any, step: int) -> None:
        """A tensor hook on the first input a gradient will reach, for each channel's mean
        |∂L/∂input|: put on before the place runs, it hears the gradient of the input as given,
        even where the place writes over it (`nn.ReLU(inplace=True)`, a node's `x.relu_()`)."""
        x = next((x for x in floats_in(input) if x.requires_grad), None)
        if x is not None and x.dim() >= 2:
            x.register_hook(_hear(weakref.ref(self), step, "in_grads", self.first))

    # -- after backward -----------------------------------------------------------------------
    def queue(self, tensors: list[torch.Tensor]) -> None:
        """Put this step's one-number tensors at the end of `tensors`, to be read with
        everyone else's."""
        self._at = len(tensors)
        tensors += self.sums + self.out_grads
        if self.activity:
            act = torch.stack(self.activity).mean(0)  # over the calls
            if self.alive and self.alive[0].shape != act.shape:
                self.alive.clear()  # the place changed width: its window starts again
            self.alive.append(act > _DEAD_EPS)
            alive = torch.stack(list(self.alive)).any(0)
            tensors += [torch.count_nonzero(~alive), _under(act)]
        if self.in_grads:
            tensors.append(_under(torch.stack(self.in_grads).mean(0)))

    def numbers(
        self,
        values: list[float],
        weights: list[float],
        grads: list[float],
        step: int,
        snapshot: bool,
        spoilt: set[int],
        blank: set[int],
    ) -> dict[str, Any]:
        """This step's numbers, from what `queue` put in `values` (read), the ‖·‖² of its
        weights and of their gradients (those that have one). `spoilt`: the ids of the
        calls, of any place, whose output was not finite this step, and `blank` those whose
        output was all zeros (`marks`)."""
        n: dict[str, Any] = {}
        got = itertools.islice(values, self._at, None)  # what `queue` put there, in order
        total = 0.0
        if weights:
            n["param_norm"] = was = math.sqrt(sum(weights))
            if self.growing is None:
                self.growing = 0 if was else self.zero.maxlen
            elif self.growing and was:
                self.growing -= 1
                self.grown_after = step
            if grads:
                n["grad_norm"] = math.sqrt(sum(grads))
            self.norms.append((step, was))
            (s0, v0), (s1, v1) = self.norms[0], self.norms[-1]
            if s1 > s0:
                n["param_norm_slope"] = (v1 - v0) / (s1 - s0)
        if self.sums:
            width = self.width
            heard = list(itertools.islice(got, len(self.sums)))
            total, zeros = sum(heard[::width], 0.0), sum(heard[1::width], 0.0)
            saturated = sum(heard[2::width], 0.0) if width > 2 else 0.0
            size = self.size or 1
            n["act_abs_mean"] = total / size
            # weights all zero give zeros of their own (trained: param_norm 0 says so; frozen:
            # no zero_frac_max, as nothing will move them); handed only zeros, it gives them back
            given_zeros = bool(self.ins) and self.ins <= blank
            frozen = self.weights if not weights and total == 0.0 else []  # (all of them)
            still = bool(frozen) and not any(q.any() for q in frozen)
            if (not weights or any(weights)) and not given_zeros and not still:
                self.zero.append(zeros / size)
            self.saturated.append(saturated / size)
            if self.zero or not (given_zeros or still):
                n["zero_frac_max"] = max(self.zero, default=zeros / size)
            n["sat_frac_max"] = max(self.saturated)
        out_grads = list(itertools.islice(got, len(self.out_grads)))
        if out_grads:
            n["out_grad_norm"] = math.sqrt(sum(v * v for v in out_grads))
        if self.sums or weights:
            seen = [total, *n.values()]
            n["nan"] = nan = any(map(math.isnan, seen))
            n["inf"] = inf = any(map(math.isinf, seen))
            if nan or inf:
                n["inherited"] = self._came_in(total, n.get("grad_norm", 0.0), out_grads, spoilt)
            else:
                self.inherited = None
        if self.activity:
            n["channels"] = self.alive[-1].numel()
            n["dead_channels"], n["dormant_channels"] = int(next(got)), int(next(got))
        if self.in_grads:
            n["input_channels"] = self.in_grads[0].numel()
            n["ignored_channels"] = int(next(got))
        if self.groups is not None and self.rows is not None:
            pairs = itertools.combinations(self.groups.values(), 2)  # the largest CKA of two
            n["cka"] = max(cka(self.rows[:, a], self.rows[:, b]) for a, b in pairs)
        if snapshot and self.rows is not None:
            n["effective_rank"] = rank = effective_rank(self.rows)
            n["rank_room"] = room = min(self.rows.shape)
            n["rank_share_start"] = self.share = rank / room if self.share is None else self.share
        return n

    def _came_in(self, total: float, grad: float, out_grads: list[float], spoilt: set[int]) -> bool:
        """Whether the NaN or inf seen here (in Σ|a| of its output, `total`, in ‖∇θ‖, `grad`, or
        in ‖∂L/∂output‖) came in: its output's when a call heard before its own first spoilt
        one gave one first (through sums, products and slices no place makes: a transformer's
        residual stream; the data counts as finite), its gradient's through its output's
        gradient (known on a snapshot step, else guessed from any spoilt output), and its
        output's gradient always (what comes after made it). Kept while it lasts, so the place
        where it arose stays the one flagged after it has spread."""
        if self.inherited is None:
            if not math.isfinite(total):
                mine = min((h for h in self.heard if h in spoilt), default=math.inf)
                self.inherited = any(h < mine for h in spoilt)
            elif not math.isfinite(grad):
                self.inherited = (
                    any(not math.isfinite(v) for v in out_grads) if out_grads else bool(spoilt)
                )
            else:  # its weights, or the gradient its output was handed
                self.inherited = any(not math.isfinite(v) for v in out_grads)
        return self.inherited

    def _fits(self, width: int) -> None:
        """Refuses groups naming a channel past the place's `width`, the first time a forward
        shows it (a measured one): the forward raises, and a Trainer's step with it, before the
        step is counted or told."""
        top = max((i for channels in self.groups.values() for i in channels), default=-1)
        if top >= width:
            raise ValueError(
                f"Audit(groups=...): groups[{self.where!r}] names channel {top}, and that place "
                f"has {width} channels (0 to {width - 1}): name channels under {width}, or "
                "group another place"
            )


def swaps(held_by: dict[str, list[tuple[str, nn.Module]]]) -> list[Any]:
    """Hooks (torch's global registration hooks; their handles, for `release` to remove) that
    warn, naming the node and the part, when a module or a weight the audit measures is given
    another in its place (transformers' `resize_token_embeddings` gives an untied model a new
    `lm_head`): the audit and the optimizer go on with the one they began with. A module given
    back a weight of its own under another name is not warned about (`torch.nn.utils.prune`
    holds `weight` as `weight_orig`, and `prune.remove` gives it back as `weight`)."""
    named = {
        id(m): (node, sub, weakref.ref(m), {id(q) for q in m.parameters(recurse=False)})
        for node, held in held_by.items()
        for path, top in held
        for sub, m in top.named_modules(prefix=path)
    }

    def replaced(module: nn.Module, name: str, new: Any) -> None:
        node, path, ref, own = named.get(id(module), (None, None, None, ()))
        if ref is None or ref() is not module or getattr(module, name, None) is new:
            return
        if isinstance(new, nn.Parameter) and id(new) in own:  # its own weight, renamed
            return
        what = "weight" if isinstance(new, nn.Parameter) else "module"
        warn(
            f"node {node!r}: {join(path, name)!r} was given a new {what} ({type(new).__name__}) "
            "while an Audit watches it: the audit goes on measuring the one it began with, which "
            "no longer runs, and an optimizer built before goes on training that one. After "
            "resizing or replacing a part, build the Trainer (and its optimizer) again, or "
            "release() the Audit and watch() the graph again"
        )

    return [
        nn.modules.module.register_module_module_registration_hook(replaced),
        nn.modules.module.register_module_parameter_registration_hook(replaced),
    ]


def marks(places: list[Place], values: list[float]) -> tuple[set[int], set[int]]:
    """When this step's calls that gave a NaN or an inf were heard (their Σ|a| is not a finite
    number), and those whose output was all zeros (Σ|a| = 0), from what each place's `queue`
    put in `values`."""
    spoilt, blank = set(), set()
    for p in places:
        for k, h in enumerate(p.heard):
            total = values[p._at + k * p.width]
            if not math.isfinite(total):
                spoilt.add(h)
            elif total == 0.0:
                blank.add(h)
    return spoilt, blank


_HEARD = itertools.count()  # the order calls are heard in, over every place and audit
_MADE: dict[int, tuple[weakref.ref, int]] = {}  # a live output's id: it, and the call that made it


def _made(t: torch.Tensor, h: int) -> None:
    """Note that call `h` made `t`, for as long as `t` lives (an id is reused once it dies)."""
    key = id(t)

    def gone(ref: weakref.ref) -> None:
        if _MADE.get(key, (None,))[0] is ref:
            del _MADE[key]

    _MADE[key] = (weakref.ref(t, gone), h)


def _maker(x: torch.Tensor) -> int:
    """The call that made `x`, if a place's call did and it still lives; else -1."""
    ref, h = _MADE.get(id(x), (None, -1))
    return h if ref is not None and ref() is x else -1


def _under(per_channel: torch.Tensor) -> torch.Tensor:
    """How many channels sit under dormant_tau of the mean over channels (none when the mean
    is 0: nothing there to be under)."""
    mean = per_channel.mean()
    return torch.count_nonzero(per_channel <= _DORMANT_TAU * mean) * (mean > 0)


def _hear(place: weakref.ref, step: int, into: str, first: bool | None) -> Any:
    """A tensor hook that keeps a number about the gradient it is handed: its norm (`first`
    None) or each channel's mean magnitude; only for the step it was registered in."""

    def hook(g: torch.Tensor) -> None:
        p = place()
        if p is not None and p.step == step:
            getattr(p, into).append(norm(g) if first is None else activity(g, first))

    return hook
