"""What a graph looks like at initialisation, place by place: `probe`.

For each node, and each box `architecture` would draw inside it (modules, the functions
between them, each call): `signal_gain` (RMS of what comes out over RMS of what goes in; none
where that is all zeros), `jacobian_gain` and `jacobian_spread` (per sample, ‖Jᵀu‖/‖u‖ for the
random cotangent u that reaches that place's output, averaged over the samples, and its
coefficient of variation across them), `zero_frac_max` and `sat_frac_max` (the share of the
output that is zero, and saturated where a sigmoid or a tanh saturates), `nan` / `inf`, and
`param_norm`, ‖θ‖ of the weights a place holds.
Each number is taken as the one forward and the one backward pass the place, so nothing is
held past the moment it is measured; no parameter gradient is made.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from typing import Any

import torch
from torch import nn

from somatize.graph import as_graph
from somatize.node import unwrap
from somatize.run import flush, note, tell, warn, watchers
from somatize.torch._modules import Held, Tap, parts_of, root_of, tensors_in, untouched
from somatize.torch._values import mapped
from somatize.torch.audit._measures import exact, norm, output_of, read, sums_of, wide
from somatize.torch.audit._place import looking, saturation
from somatize.torch.inside._forward import Boxes
from somatize.torch.inside._trace import call_path
from somatize.torch.inside.architecture import given, run_here

__all__ = ["probe"]


_LEAFED = (
    "probe ran this forward with the example's floating tensors asking for their gradient (it "
    "measures each place's Jacobian); a model that refuses such an input in train mode "
    "(setting requires_grad on a view of it) is probed in eval mode: model.eval()"
)

_OVERWRITTEN = (
    "probe takes one backward through the forward, and this forward wrote over a tensor its "
    "gradient needs (a plain forward then .backward() fails alike): a state held in a cache "
    "of the example and updated in place (Mamba's) is one: probe the whole sequence without a "
    "cache (use_cache=False)"
)

_REENTRANT = (
    "runs torch.utils.checkpoint with use_reentrant=True, which torch.autograd.grad cannot "
    "differentiate through, and probe takes each place's Jacobian so (no parameter gradient "
    "made): checkpoint with use_reentrant=False (transformers' default), which probe measures "
    "as it measures the net without checkpointing, or probe with checkpointing off"
)


def _first(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The first floating-point tensor of `tensors`, if any."""
    return next((t for t in tensors if t.is_floating_point()), None)


def _checkpointing(grown: dict[str, list[Any]]) -> str:
    """The first node, as they ran, whose part of the autograd graph (from the `grad_fn`s of
    what it gave, down to what earlier nodes made) holds a reentrant checkpoint's backward."""
    seen: set[Any] = set()
    for node, todo in grown.items():
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                if fn.name() == "CheckpointFunctionBackward":
                    return node
                todo.extend(f for f, _ in fn.next_functions)
    return "?"


def _per_sample(g: torch.Tensor, rows: int) -> list[float]:
    """‖g‖ of each sample (a row of the first dimension), or of the whole when `rows` is 0,
    accumulated in float32 or wider (`exact`)."""
    flat = g.reshape(rows or 1, -1)
    found = torch.linalg.vector_norm(flat, dim=1, dtype=wide(g)).tolist()
    return [exact(v, row) for v, row in zip(found, flat, strict=True)]


class _Seen:
    """What is known of one tensor a place reads or makes, as it was when first seen, once
    however many places share it: its norm (taken then, read later) and RMS (None until
    read), and the per-sample norms of its gradient, keyed by how many rows they are taken
    over, filled by a hook as the backward passes (put on then: a tensor written over in
    place later still hears the gradient of what it was). It holds the tensor by weak
    reference: nothing is kept alive that the forward would let go."""

    __slots__ = ("ref", "size", "norm", "rms", "rows", "hook")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.size = t.numel()
        self.norm = norm(t.detach())
        self.rms: float | None = None
        self.rows: dict[int, Any] = {}
        self.hook = None  # taken off when the probe ends: a parameter outlives it
        if t.requires_grad:
            rows = self.rows

            def heard(g: torch.Tensor) -> None:
                for r in rows:
                    rows[r] = _per_sample(g, r)

            self.hook = t.register_hook(heard)

    def grads(self, rows: int) -> dict[int, Any]:
        """Where the per-sample norms of the tensor's gradient will be, keyed by `rows`."""
        self.rows.setdefault(rows, None)
        return self.rows


class _Tensors:
    """What is known of each tensor the places read or make (`_Seen`), by id."""

    def __init__(self) -> None:
        self.by: dict[int, _Seen] = {}
        self.hooks: list[Any] = []  # every hook put on, forgotten tensors' too
        self.sources: list[torch.Tensor] = []  # where a gradient has to be asked for

    def known(self, t: torch.Tensor) -> _Seen | None:
        """What was seen of `t`, if anything (an id is only that tensor's while it lives)."""
        seen = self.by.get(id(t))
        return seen if seen is not None and seen.ref() is t else None

    def of(self, t: torch.Tensor, *, afresh: bool = False) -> _Seen:
        """What is known of `t`; `afresh`, of what it holds now (a call gave it back)."""
        seen = None if afresh else self.known(t)
        if seen is None:
            seen = self.by[id(t)] = _Seen(t)
            self.hooks.append(seen.hook)
        return seen

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """A call gave `tensors` back, one it was handed perhaps written over in place: what
        was known of them is no longer what they hold."""
        for t in tensors:
            self.by.pop(id(t), None)


class _Place:
    """One place: what its first call gave, measured as it went by; and the per-sample norms
    of the gradients at its input and output, heard as the backward passed."""

    __slots__ = (
        "saturates",
        "weights",
        "numbers",
        "rows",
        "g_in",
        "g_out",
    )

    def __init__(self, module: nn.Module | None) -> None:
        self.saturates = saturation(module)
        self.weights = list(module.parameters()) if module is not None else []
        self.numbers: dict[str, Any] | None = None
        self.rows = 0
        self.g_in: dict[int, Any] = {}  # by rows, as `_Seen.grads` keeps them
        self.g_out: dict[int, Any] = {}

    def saw(self, given: list[torch.Tensor], made: list[torch.Tensor], known: _Tensors) -> None:
        """Measure the call that made the tensors `made` of the tensors `given`: Σ|a|, the
        zeros (and the saturated) of its output, the norm of its input and of its output, each
        not read yet, and of the weights it holds, all read at once. A call that gave back a
        tensor it was handed (written over in place, or handed on as it is) is measured against
        that tensor as it was seen before the call, and left out where it was not (what it read
        is gone)."""
        inp, out = _first(given), output_of(made)
        if out is None:
            return
        i = None
        if inp is not None:
            i = known.known(inp)
            if i is None and any(inp is t for t in made):
                known.forget(made)
                return
            i = i or known.of(inp)
        o = known.of(out, afresh=True)
        a = out.detach()
        size = a.numel()
        sums = sums_of(a, self.saturates)
        fresh = [s for s in (i, o) if s is not None and s.rms is None]  # no RMS read yet
        weights = [w.detach() for w in self.weights]  # ‖θ‖ builds no graph (a checkpoint counts it)
        values = read(sums + [s.norm for s in fresh] + [norm(w) for w in weights])  # one read
        for s, v in zip(fresh, values[len(sums) : len(sums) + len(fresh)], strict=True):
            s.rms = exact(v, s.ref()) / s.size**0.5 if s.size else 0.0
        n = self.numbers = {}
        if weights:
            n["param_norm"] = math.hypot(*map(exact, values[-len(weights) :], weights))
        # a gain against zeros (a dead layer before) means nothing, nor one against an input
        # that asks for its gradient where the output does not: made without autograd, it is
        # not seen computed from it (rotary positions, handed the states for their dtype)
        if i is not None and i.rms > 0 and (out.requires_grad or not inp.requires_grad):
            n["signal_gain"] = o.rms / i.rms
        total, zeros, *saturated = values[: len(sums)]
        # the zeros of a place given only zeros are its input's, and all-zero products of a
        # factor of zeros are that factor's (Mamba's scan starting from a state of zeros)
        given_zeros = (
            size
            and zeros == size
            and any(t is not inp and t.is_floating_point() and not t.any() for t in given)
        )
        if (i is None or i.rms != 0) and not given_zeros:
            n["zero_frac_max"] = zeros / size if size else 0.0
        n["sat_frac_max"] = saturated[0] / size if size and saturated else 0.0
        finite = math.isfinite(total)  # a NaN or an inf anywhere shows in Σ|a|
        n["nan"] = False if finite else bool(a.isnan().any())
        n["inf"] = False if finite else bool(a.isinf().any())
        if inp is not None and inp.dim() and out.dim() and inp.shape[0] == out.shape[0]:
            self.rows = out.shape[0]
        if out.requires_grad:
            self.g_out = o.grads(self.rows)
            if i is not None and inp.requires_grad:
                self.g_in = i.grads(self.rows)
            else:
                known.sources.append(out)  # the gradient starts nowhere before: ask for it here

    def answer(self) -> dict[str, Any]:
        n = dict(self.numbers or {})
        g_in, g_out = self.g_in.get(self.rows), self.g_out.get(self.rows)
        if self.g_in and g_in is None and g_out is not None:
            # the backward passed the output and never reached the input: the output is not
            # computed from it (a float attention mask), and a gain against it means nothing
            n.pop("signal_gain", None)
        elif g_in is not None and g_out is not None:
            ratio = [a / b for a, b in zip(g_in, g_out, strict=True) if b > 0]
            if ratio:
                mean = math.fsum(ratio) / len(ratio)
                n["jacobian_gain"] = mean
                if len(ratio) > 1:
                    var = math.fsum((r - mean) ** 2 for r in ratio) / len(ratio)
                    n["jacobian_spread"] = math.sqrt(var) / mean if mean > 0 else 0.0
        return n


class _Probing(Boxes):
    """The boxes `architecture` draws inside one node's root, each a place measured on its
    first call as it ends; a closed module's input is first seen as its call begins (a module
    may write over it in place). `answered()` says which of them `probe` answers."""

    def __init__(self, node: str, root: nn.Module, depth: int, most: int, known: _Tensors):
        super().__init__(root, depth)
        self.node = node
        self.most = most
        self.known = known
        self.places: dict[str, _Place] = {}  # every box, in the order they ran
        self.ends: dict[str, _Place] = {}  # each open block's call: the last box inside it

    def _place(self, box: str, module: nn.Module | None) -> _Place | None:
        """The place `box`'s call is measured at, unless it was already."""
        place = self.places.get(box)
        if place is None:
            place = self.places[box] = _Place(module)
        return place if place.numbers is None else None

    def answered(self) -> list[tuple[str, _Place]]:
        """The boxes and blocks answered, as they ran, each call of a block with the place of
        the last box that ran in it (which made what it gives back). Past `most` of them, the
        blocks are closed as `architecture` closes them, the deepest first, each then one box,
        until `most` or fewer are left, all answered; and at each depth on the way, the first
        half and the last half of the boxes drawn there (the deepest: every box), so a model's
        input end and its head are answered, and the last copy of a box that a figure, folding
        the copies, draws open at a `most` this count closes."""
        order: dict[str, _Place] = {}  # blocks and boxes, a block first
        for box, place in self.places.items():
            for block in itertools.accumulate(box.split(".")[:-1], "{}.{}".format):
                order[block] = place  # (one never called, a ModuleList: its last box)
            order[box] = place
        order.update(self.ends)  # a call of a block, the last box in it (later calls last)
        level = {k: k.count(".") for k in order}
        chosen: set[str] = set()
        for depth in range(max(level.values(), default=0), -1, -1):  # the deepest open first
            upto = [k for k in order if level[k] <= depth]
            if len(upto) <= self.most:
                chosen.update(upto)
                break
            drawn = [k for k in upto if level[k] == depth or k in self.places]  # blocks shut
            drawn[(self.most + 1) // 2 : len(drawn) - self.most // 2] = []
            chosen.update(drawn)
        return [(k, p) for k, p in order.items() if k in chosen]

    def _left(self, path: str, call: int, outs: list) -> None:
        last = next(reversed(self.places), "")
        if last.startswith(path + "."):  # the last box that ran in this call of the block
            self.ends[path if call == 1 else f"{path}#{call}"] = self.places[last]

    def _heard(self, box: str, module: Any, given: list, outs: list) -> None:
        place = self._place(box, module)
        if place is None:
            self.known.forget(outs)
        else:
            place.saw(given, outs, self.known)

    def _began(self, path: str, call: int, module: nn.Module, given: list[torch.Tensor]) -> None:
        inp = _first(given)
        if inp is not None and self._place(call_path(path, call), module) is not None:
            self.known.of(inp)

    def _ended(self, box: str, module: nn.Module, given: list, outs: list) -> None:
        super()._ended(box, module, given, outs)
        self._heard(box, module, given, outs)

    def _function(self, box: str, block: Any, call: tuple, made: frozenset, ins: list, outs: list):
        self._heard(box, None, ins, outs)


def probe(
    graph: Any,
    example: Any,
    *,
    depth: int = 0,
    most: int = 48,
    probes: int = 24,
    watching: Any = None,
    broker: Any = None,
) -> dict[str, dict[str, Any]]:
    """What this graph looks like at initialisation, as {where: numbers}.

    `where` is a node, or `node.path.to.submodule` — the same keys the audit uses and the
    same boxes the figure draws (`depth` opens composites as in `architecture`; the functions
    between modules, `relu`, `cat`, and a module's later calls, `pool#2`, are places too; a
    block is answered with the numbers of the last box that ran in it, so a block drawn closed
    is coloured; past `most` boxes in a node, its blocks closed as `architecture` closes
    them, and at each depth on the way the first half and the last half of the boxes drawn
    there as they ran, so its head is among them), so a finding from a probe lands on the box
    a finding from a run would. A call that writes over what it read (`out += identity`,
    `x.relu_()`, a module changing its input in place) or hands its input back (a `Dropout` in
    eval mode) is measured against its input as it was before the call (a module's is read as
    its call begins), and the boxes after it against what it gave; only an in-place function
    on a tensor no box made (the model's input, a slice) is not, its input gone.
    Each place's numbers are `signal_gain`, `jacobian_gain`, `jacobian_spread`,
    `zero_frac_max` (not where it was given only zeros: those are its input's),
    `sat_frac_max`, `nan`, `inf` (see the module's docstring) and, where it holds weights,
    their `param_norm` (all zero: a zero-initialised layer, not DEAD), the shape
    `somatize.health.seen` returns from a store, which `somatize.health.verdict` reads.

    The example is measured as it is given, in one forward and one backward: a sample is a
    row of its first dimension, each with its own random direction, and `jacobian_spread`
    (across samples) needs two or more rows: with one it is left out, and a warning says so.
    `probes` is kept for the published signature: a positive number, it changes nothing.
    `graph` may be a bare module, and an `Opaque` example is unwrapped. `watching=` takes a
    Recorder or anything callable: it hears the forward's `ran` and `finished`, then one flat
    `health` fact per place (step 0); a block answered with its last box's numbers, where that
    box is answered too, says in its fact which box it repeats instead (`"repeats":
    "net.0.1"`), so a health view over them flags each place once, at the box.
    Deterministic, and side-effect free; the net is left as it was. A model that refuses, in
    train mode, an input asking for its gradient (transformers' Wav2Vec2) is probed after
    `model.eval()`, and its error says so. The graph runs here, as `architecture` runs it: a
    node `.at(host)` is probed in its copy here (`broker` is not needed).
    """
    if not isinstance(probes, int) or isinstance(probes, bool) or probes < 1:
        raise ValueError(f"probes is a number of directions ≥ 1, not {probes!r}")
    told = watchers(watching)
    g = as_graph(graph)
    example = unwrap(example)
    for t in tensors_in(example):
        if t.numel() == 0:
            raise ValueError(
                f"probe: the example holds an empty tensor (shape {tuple(t.shape)}), so there "
                "is nothing to measure: give one or more samples"
            )
    roots = {node: root_of(g.implementation(node)) for node in g.nodes()}
    nodes = {n: _Place(r) for n, r in roots.items()}
    known = _Tensors()
    grown: dict[str, list[Any]] = {}  # what each node gave, as autograd nodes (`_checkpointing`)
    hooks = [
        _Probing(node, root, depth, most, known)
        for node, root in roots.items()
        if root is not None and parts_of(root)
    ]

    def heard(node: str, input: Any, ctx: Any, out: Any) -> None:
        with contextlib.ExitStack() as quiet:  # (its own measuring is no layer of a node's)
            for reading in hooks:
                quiet.enter_context(reading.paused())
            if nodes[node].numbers is None:  # the first call is the place's
                grown[node] = [t.grad_fn for t in tensors_in(out)]
                nodes[node].saw(tensors_in(input), tensors_in(out), known)

    kept = {n: r for n, r in roots.items() if r is not None}
    held = Held(list(kept.values()), list(kept))
    held.refuse(reads="probe")
    try:
        with untouched(held), looking():
            x = mapped(example, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()))
            try:
                held.differentiable()
                for h in hooks:
                    h.arm()
                with Tap(g, heard, roots):
                    result = run_here(g, x, told)
            except Exception as e:
                if "requires_grad" in str(e):  # torch refusing the input asking for its gradient
                    note(e, _LEAFED)
                raise
            finally:
                for h in hooks:
                    h.disarm()
            outs = [t for t in given(g, result) if t.requires_grad and t.is_floating_point()]
            ends = {id(t): t for t in [*tensors_in(x), *known.sources] if t.requires_grad}
            ends = list(ends.values())
            if outs and ends:
                gen = torch.Generator().manual_seed(0)
                cot = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outs]
                try:
                    torch.autograd.grad(outs, ends, grad_outputs=cot, allow_unused=True)
                except RuntimeError as e:
                    if "inplace" in str(e):
                        note(e, _OVERWRITTEN)
                    if "use_reentrant=True" in str(e):
                        node = _checkpointing(grown)
                        raise RuntimeError(f"probe: node {node!r} {_REENTRANT}") from e
                    raise
            del outs, ends, result, x
            known.sources.clear()
            grown.clear()
    finally:  # what a hook was put on outlives the probe (a parameter read as it is)
        for hook in filter(None, known.hooks):
            hook.remove()
    answer: dict[str, dict[str, Any]] = {}
    facts = []  # the same, as health facts for `watching` (a block's names its box)
    box: dict[int, str] = {}  # where each place is deepest: its box (a block's is above it)
    one = False
    inner = {h.node: h for h in hooks}
    measured: dict[int, dict[str, Any]] = {}  # each place's numbers once (a block's: a box's)
    for node, place in nodes.items():
        for inside, p in [(None, place), *(inner[node].answered() if node in inner else [])]:
            where = f"{node}.{inside}" if inside else node
            if p.numbers is not None and where not in answer:
                numbers = measured[id(p)] = measured.get(id(p)) or p.answer()
                answer[where] = dict(numbers)
                box[id(p)] = max(box.get(id(p), where), where, key=lambda w: w.count("."))
                fact = {"fact": "health", "node": node, "inside": inside, "step": 0}
                facts.append((where, p, fact))
                one = one or p.rows == 1
    if one:
        warn(
            "probe: the example holds one sample (its first dimension is 1), so "
            "jacobian_spread, which compares samples, is left out: give two or more"
        )
    for where, p, fact in facts:
        fact.update(measured[id(p)] if box[id(p)] == where else {"repeats": box[id(p)]})
    tell(told, *(fact for _, _, fact in facts))
    flush(told)
    return answer
