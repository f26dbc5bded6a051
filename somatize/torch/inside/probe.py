"""What a graph looks like at initialisation, place by place: `probe`.

For each node, and each layer `architecture` would draw inside it: signal gain (RMS of what
comes out over RMS of what goes in), jacobian gain and spread (per sample, ‖Jᵀu‖/‖u‖ for a
random cotangent u pulled back through that place, averaged, and its coefficient of variation),
zero and saturated fractions of the output, and whether any of it is nan or inf.

One forward and one backward through the whole graph, on the example tiled to `probes`
samples, so every sample carries its own random direction. The net is left exactly as it
was: no gradient lands in `.grad`, batch-norm statistics and modes are put back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from somatize.torch._modules import (
    Tap,
    _One,
    as_graph,
    join,
    named_modules_of,
    tensors_in,
    untouched,
)
from somatize.torch.audit._measures import _DEAD_EPS, _HIGH, _LOW
from somatize.torch.audit._place import _saturation
from somatize.torch.inside._trace import Opening

__all__ = ["probe"]


def _layers(module: nn.Module, depth: int) -> list[tuple[str, nn.Module]]:
    """The modules drawn as one layer inside `module`, in declaration order."""
    if next(module.children(), None) is None:
        return []
    opening = Opening(module, depth)
    found: list[tuple[str, nn.Module]] = []

    def visit(path: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            p = join(path, name)
            if opening.closed(p):
                found.append((p, child))
            else:
                visit(p, child)

    visit("", module)
    return found


def _tile(value: Any, n: int) -> Any:
    """Every tensor with fewer than `n` rows repeated up to exactly `n`."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] >= n:
            return value
        reps = -(-n // value.shape[0])
        return value.repeat(reps, *([1] * (value.dim() - 1)))[:n]
    if isinstance(value, dict):
        return {k: _tile(v, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tile(v, n) for v in value)
    return value


def _leafed(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(True)
    if isinstance(value, dict):
        return {k: _leafed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_leafed(v) for v in value)
    return value


def _first(value: Any) -> torch.Tensor | None:
    for t in tensors_in(value):
        if t.is_floating_point():
            return t
    return None


class _Seen:
    __slots__ = ("where", "saturates", "inp", "out")

    def __init__(self, where: str, modules: list[nn.Module]) -> None:
        self.where = where
        self.saturates = _saturation([s for m in modules for s in m.modules()])
        self.inp: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def saw(self, inp: Any, out: Any) -> None:
        if self.out is None:
            self.inp, self.out = _first(inp), _first(out)


def _rms(t: torch.Tensor, memo: dict[int, float]) -> float:
    known = memo.get(id(t))
    if known is None:
        n = t.numel()
        known = float(torch.linalg.vector_norm(t.detach())) / n**0.5 if n else 0.0
        memo[id(t)] = known
    return known


def _per_sample(g: torch.Tensor, rows: int) -> torch.Tensor:
    if rows:
        return torch.linalg.vector_norm(g.reshape(rows, -1), dim=1)
    return torch.linalg.vector_norm(g).reshape(1)


def _numbers(s: _Seen, grads: dict[int, torch.Tensor], memo: dict[int, float]) -> dict[str, Any]:
    out = s.out
    assert out is not None
    a = out.detach()
    n: dict[str, Any] = {}
    if s.inp is not None:
        before = _rms(s.inp, memo)
        n["gain"] = _rms(out, memo) / before if before > 0 else float("inf")
        g_in, g_out = grads.get(id(s.inp)), grads.get(id(out))
        if g_in is not None and g_out is not None:
            same = g_in.dim() and g_out.dim() and g_in.shape[0] == g_out.shape[0]
            rows = g_in.shape[0] if same else 0
            top, bottom = _per_sample(g_in, rows), _per_sample(g_out, rows)
            ok = bottom > 0
            if bool(ok.any()):
                ratio = (top[ok] / bottom[ok]).double()
                mean = float(ratio.mean())
                n["jacobian_gain"] = mean
                spread = float(ratio.std(unbiased=False)) / mean if mean > 0 else 0.0
                n["jacobian_spread"] = spread
    size = a.numel()
    n["zero"] = int((a.abs() <= _DEAD_EPS).sum()) / size if size else 0.0
    if s.saturates == "sigmoid":
        n["saturated"] = int(((a <= _LOW) | (a >= _HIGH)).sum()) / size
    elif s.saturates == "tanh":
        n["saturated"] = int((a.abs() >= _HIGH).sum()) / size
    else:
        n["saturated"] = 0.0
    finite = bool(torch.isfinite(a).all())
    n["nan"] = False if finite else bool(a.isnan().any())
    n["inf"] = False if finite else bool(a.isinf().any())
    return n


def _tell(watching: Any, facts: list[dict[str, Any]]) -> None:
    told = watching if isinstance(watching, (list, tuple)) else [watching]
    for w in told:
        if not callable(w):
            raise TypeError(f"watching= takes a Recorder or a callable, not {type(w).__name__}")
    for w in told:
        for fact in facts:
            w(fact)
        flush = getattr(w, "flush", None)
        if callable(flush):
            flush()


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
    same scope the figure draws (`depth` opens composites as in `architecture`, at most `most`
    layers per node), so a finding from a probe lands on the box a finding from a run would.
    The answer is the shape `somatize.health.seen` returns from a store, and
    `somatize.health.verdict` reads it. `probes` is how many random directions the jacobian is
    taken along (the example is tiled to that many samples). `watching=` takes a Recorder or
    anything callable, told one `health` fact per place. Deterministic, and side-effect free.
    """
    if not isinstance(probes, int) or probes < 1:
        raise ValueError(f"probes is a number of directions ≥ 1, not {probes!r}")
    g = as_graph(graph)
    seen: dict[str, _Seen] = {}
    handles: list[Any] = []
    modules: list[nn.Module] = []
    for node in g.nodes():
        held = named_modules_of(g.implementation(node))
        modules.extend(m for _, m in held)
        seen[node] = _Seen(node, [m for _, m in held])
        inner: list[tuple[str, nn.Module]] = []
        for name, module in held:
            inner.extend((join(name, p), m) for p, m in _layers(module, depth))
            if name and next(module.children(), None) is None:
                inner.append((name, module))
        for path, m in inner[:most]:
            where = f"{node}.{path}"
            s = seen[where] = _Seen(where, [m])
            handles.append(m.register_forward_hook(lambda m, i, o, s=s: s.saw(i, o)))

    def heard(node: str, input: Any, ctx: Any, out: Any) -> None:
        s = seen.get(node)
        if s is not None:
            s.saw(input, out)

    try:
        with untouched(modules, seed=0), Tap(g, heard):
            for m in modules:
                for sub in m.modules():
                    if isinstance(getattr(sub, "inplace", None), bool):
                        sub.inplace = False
            gen = torch.Generator().manual_seed(0)
            x = _leafed(_tile(example, probes))
            if broker is not None and not isinstance(g, _One):
                result = g.forward(x, broker=broker)
            else:
                result = g.forward(x)
            outs = [t for t in tensors_in(result) if t.is_floating_point() and t.requires_grad]
            wanted: dict[int, torch.Tensor] = {}
            for s in seen.values():
                for t in (s.inp, s.out):
                    if t is not None and t.requires_grad:
                        wanted[id(t)] = t
            grads: dict[int, torch.Tensor] = {}
            if outs and wanted:
                cot = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outs]
                keys = list(wanted)
                got = torch.autograd.grad(
                    outs, [wanted[k] for k in keys], grad_outputs=cot, allow_unused=True
                )
                grads = {k: v for k, v in zip(keys, got, strict=True) if v is not None}
            memo: dict[int, float] = {}
            answer = {w: _numbers(s, grads, memo) for w, s in seen.items() if s.out is not None}
    finally:
        for h in handles:
            h.remove()
    if watching is not None:
        _tell(
            watching,
            [{"fact": "health", "where": w, "step": 0, "numbers": n} for w, n in answer.items()],
        )
    return answer
