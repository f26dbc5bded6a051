"""The numbers an `Audit` takes, as plain functions of tensors that keep no state (`_place.py`
keeps what a place carries from step to step)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from somatize.health import Thresholds
from somatize.torch._modules import tensors_in

_DEFAULT = Thresholds()
_DEAD_EPS = _DEFAULT.dead_eps  # |a| at most this counts as zero
_DORMANT_TAU = _DEFAULT.dormant_tau  # a channel under this share of the mean is dormant
# a sigmoid output at most _LOW or at least _HIGH is saturated; a tanh one at |a| ≥ _HIGH
_LOW, _HIGH = 0.01, 0.99
_ROWS = 128  # the most samples an effective rank or a CKA is taken over
_EXACT = 64  # σ_max exactly up to this smaller side; past it, svd_lowrank


def outside_autocast(*kinds: str) -> contextlib.ExitStack:
    """Autocast turned off for the device types `kinds` (with none, "cpu" and "cuda") where it
    is on: an audit measures in the dtype of what it measures, and torch's recipe runs the
    backward so, whatever autocast a user wrapped round a whole fit."""
    off = contextlib.ExitStack()
    for kind in [k for k in kinds or ("cpu", "cuda") if k in ("cpu", "cuda")]:
        if torch.is_autocast_enabled(kind):
            off.enter_context(torch.autocast(kind, enabled=False))
    return off


def floats_in(value: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a value (inside dicts, lists, tuples, an `Opaque`, or a
    mapping such as a transformers `ModelOutput`), in order."""
    return [t for t in tensors_in(value) if t.is_floating_point()]


def output_of(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """What a place gives, of the tensors it made (in order, as `tensors_in` lists them): the
    first floating-point one that holds more than one number (a loss given first, as
    transformers' models given labels do, is not what it makes), else the first floating-point
    one; None for none."""
    floats = [t for t in tensors if t.is_floating_point()]
    for t in floats:
        if t.dim():
            return t
    return floats[0] if floats else None


def wide(t: torch.Tensor) -> torch.dtype | None:
    """The dtype a reduction over `t` accumulates in: float32 for half precisions."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None


def sums_of(a: torch.Tensor, saturates: str | None) -> list[torch.Tensor]:
    """Σ|a|, how many values of `a` are zero (|a| ≤ dead_eps) and, for a place that saturates,
    how many are saturated, as one-number tensors (read later, all at once), accumulated in
    float32 or wider. The zeros are a float sum of 1.0s (cheaper than a boolean count on the
    CPU; exact up to 2²⁴ values). An inf makes Σ|a| inf and a NaN makes it NaN, which is how
    `nan` and `inf` are told apart; a NaN is neither zero nor saturated."""
    magnitude = a.abs()
    if magnitude.dtype not in (torch.float32, torch.float64):
        magnitude = magnitude.float()
    total = magnitude.sum()
    if saturates == "sigmoid":
        saturated = torch.count_nonzero((a <= _LOW) | (a >= _HIGH))
    elif saturates == "tanh":
        saturated = torch.count_nonzero(magnitude >= _HIGH)
    zeros = magnitude.le_(_DEAD_EPS).sum()  # in place, after everything else read it
    return [total, zeros] if saturates is None else [total, zeros, saturated]


def norm(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """‖t‖ as a one-number tensor, accumulated in `dtype`, else float32 or wider (called under
    no_grad); of a sparse tensor (the gradient of an `nn.Embedding(sparse=True)`), of its
    values, duplicates summed. Values too large or too small for float32 to square read wrong:
    `exact` tells."""
    if t.layout is not torch.strided:
        t = t.coalesce().values() if t.layout is torch.sparse_coo else t.values()
    return torch.linalg.vector_norm(t, dtype=dtype or wide(t))


def exact(v: float, t: torch.Tensor) -> float:
    """‖t‖ from its `norm` as read (`v`), taken again in float64 where float32 could not square
    its values: inf (too large; an inf then means an infinity, a NaN a NaN), or an RMS under
    1e-18, whose squares lose their digits under float32's normal numbers (EfficientNet's
    vanishing signal, which read 0 or a half off)."""
    if v == math.inf or v < 1e-18 * t.numel() ** 0.5:  # (a norm is never -inf)
        return float(norm(t.detach(), torch.float64))
    return v


def squared_norms(norms: list[float], tensors: list[torch.Tensor]) -> list[float]:
    """‖t‖² of each of `tensors` from its `norm` as read, by `exact`."""
    return [exact(v, t) ** 2 for v, t in zip(norms, tensors, strict=True)]


def read(tensors: list[torch.Tensor]) -> list[float]:
    """One-number tensors as Python numbers: on the CPU one `.item()` each; on an accelerator
    one stack and one `.tolist()` per device and dtype, so a step waits for it once."""
    if not tensors or tensors[0].is_cpu:
        return [t.item() for t in tensors]
    out: list[Any] = [0.0] * len(tensors)
    by: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault((t.device, t.dtype), []).append(i)
    for idx in by.values():
        for i, v in zip(idx, torch.stack([tensors[i] for i in idx]).tolist(), strict=True):
            out[i] = v
    return out


def channel_view(t: torch.Tensor, first: bool) -> torch.Tensor:
    """(samples, channels): channels on dim 1 for images and where they come `first` (a 1-d
    conv's (N, C, L) output, and what a norm or an activation made of it: `_place.layouts`),
    the last dim otherwise (a sequence's features)."""
    if t.dim() <= 1:
        return t.reshape(1, -1)
    if t.dim() >= 4 or (first and t.dim() == 3):
        return t.movedim(1, -1).reshape(-1, t.shape[1])
    return t.reshape(-1, t.shape[-1])


def activity(t: torch.Tensor, first: bool) -> torch.Tensor:
    """Each channel's mean |value| over samples (and positions), in float32 or wider."""
    view = channel_view(t.detach(), first)
    return view.abs().mean(0, dtype=wide(view))


def rows_of(t: torch.Tensor, first: bool) -> torch.Tensor | None:
    """At most `_ROWS` samples of the channel view, evenly spaced and copied (the output may
    be written over in place after the place saw it), in float32 or wider; None for fewer
    than two samples."""
    view = channel_view(t.detach(), first)
    if view.shape[0] < 2:
        return None
    stride = max(1, view.shape[0] // _ROWS)
    rows = view[::stride][:_ROWS]
    return rows.float() if wide(rows) else rows.clone()


def _gram(x: torch.Tensor) -> torch.Tensor:
    """The Gram matrix of a matrix's smaller side: its eigenvalues are the squared singular
    values."""
    return x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x


def _unit(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`x` in float32 or wider divided by its norm (so no square of it overflows), and the
    norm (taken in float64; not a finite number when `x` holds an inf or a NaN)."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    scale = float(norm(x, torch.float64))
    return (x / scale if 0 < scale < math.inf else x), scale


def effective_rank(rows: torch.Tensor) -> float:
    """exp of the entropy of the normalised singular values of the centred rows (Roy &
    Vetterli): 1 for a representation that spans one direction, up to min(rows, columns).
    The singular values come from `eigvalsh` of the Gram matrix of the rows scaled to norm 1;
    those its rounding cannot tell from zero (under n·ε of the largest eigenvalue, or under
    max(m, n) · ε, as `torch.linalg.matrix_rank` counts) are left out, so a collapsed
    representation reads as collapsed. 0 for rows that do not vary, or hold an inf or a NaN."""
    unit, scale = _unit(rows)
    if not 0 < scale < math.inf:
        return 0.0
    eps = torch.finfo(unit.dtype).eps
    squares = torch.linalg.eigvalsh(_gram(unit - unit.mean(0, keepdim=True))).tolist()
    floor = max(squares[-1] * len(squares) * eps, (max(rows.shape) * eps) ** 2)
    s = [math.sqrt(v) for v in squares if v > floor]
    if not s:
        return 0.0
    total = sum(s)
    return math.exp(-sum(v / total * math.log(v / total) for v in s))


def _top(d: torch.Tensor) -> float:
    """σ_max of a matrix: from `eigvalsh` of its Gram matrix when its smaller side is at most
    `_EXACT`, else the top value of `svd_lowrank` (never above σ_max; its random start is
    drawn with the device's generator state put back after, so the caller's stream is kept)."""
    if min(d.shape) <= _EXACT:
        return math.sqrt(max(float(torch.linalg.eigvalsh(_gram(d))[-1]), 0.0))
    devices = [d.device.index or 0] if d.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # its draws are put back after
        return float(torch.svd_lowrank(d, q=4, niter=1)[1][0])


def stable_rank(d: torch.Tensor) -> float:
    """‖D‖_F² / ‖D‖_2² of an update (flattened past its first dimension): about how many
    directions it moves the weight in; 1 / σ_max² of D scaled to norm 1. 0 for no update, and
    for one holding an inf or a NaN."""
    if d.layout is not torch.strided:
        d = d.to_dense()
    unit, scale = _unit(d.reshape(d.shape[0], -1))
    if not 0 < scale < math.inf:
        return 0.0
    top = _top(unit)
    return 1.0 / (top * top) if top > 0 else 0.0


def cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two (samples, features) matrices, in float64: 1 when one is a rotation
    and scaling of the other, near 0 when they are unrelated; 0 when either does not vary."""
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    xy = float((y.T @ x).pow(2).sum())
    den = float((x.T @ x).pow(2).sum().sqrt() * (y.T @ y).pow(2).sum().sqrt())
    return xy / den if den > 0 and math.isfinite(den) else 0.0
