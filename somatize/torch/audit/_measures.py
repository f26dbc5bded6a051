"""The numbers an `Audit` takes on a snapshot step, and the channel views it takes them on.

A snapshot step's eigenvalues are read once (one `.tolist()` per Gram size) and what is made
of them — an effective rank's entropy, a stable rank's ratio — is a few dozen float64
operations in Python: on a step that comes once in fifty, each small tensor operation costs
several microseconds cold, more than the arithmetic it would do.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "channel_view",
    "numpy_views",
    "square_of",
    "squares_of",
    "cka",
    "dense",
    "effective_rank",
    "effective_ranks",
    "later_sums",
    "read",
    "spectra",
    "stable_of",
    "stable_rank",
]

# the smaller side up to which σ_max is taken exactly, from the eigenvalues of the Gram matrix;
# past it, by at most this many Lanczos steps, stopping early (checked after the steps in
# `_CHECKS`) once the top Ritz pair's residual is under `_TOL` of its value
_EXACT = 96
_STEPS = 12
_CHECKS = (4, 8)
_POWER = (4, 6)  # the power steps after which `_power` checks whether it has settled
_TOL = 1e-3
_FLOOR = 4 * torch.finfo(torch.float32).eps
_NUMPY = (torch.float32, torch.float64)
_DEAD_EPS = 1e-7  # |a| at most this is zero (the health thresholds' dead_eps)
# a sigmoid output at most _LOW or at least _HIGH is saturated; a tanh one at |a| ≥ _HIGH
_LOW, _HIGH = 0.01, 0.99


def read(tensors: list[torch.Tensor]) -> list[float]:
    """Many one-number tensors as Python numbers: on the CPU one `.item()` each (cheaper than
    stacking them: ≈ 6 µs for 33 against ≈ 9), elsewhere one stack and one `.tolist()` (one
    per device when they are spread over several), so a GPU step synchronises once."""
    if not tensors:
        return []
    if tensors[0].device.type == "cpu":
        return [t.item() for t in tensors]
    try:
        return torch.stack(tensors).tolist()
    except RuntimeError:  # on more than one device
        pass
    out = [0.0] * len(tensors)
    by: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault(t.device, []).append(i)
    for idx in by.values():
        for i, v in zip(idx, torch.stack([tensors[i] for i in idx]).tolist(), strict=True):
            out[i] = v
    return out


def numpy_views(tensors: list[torch.Tensor]) -> list[np.ndarray] | None:
    """Each tensor's values as a flat numpy array sharing its memory, when every one is a
    dense, contiguous float32 or float64 tensor on the CPU that asks for no gradient; None
    otherwise (the caller then takes torch's way)."""
    views = []
    for t in tensors:
        if t.dtype not in _NUMPY or t.layout is not torch.strided or not t.is_contiguous():
            return None
        try:
            views.append(t.numpy().reshape(-1))  # refuses another device, a conj or neg view
        except (RuntimeError, TypeError):
            return None
    return views


def dense(t: torch.Tensor) -> torch.Tensor:
    """What a norm of `t` is taken on: `t`, or for a sparse tensor (the gradient of an
    `nn.Embedding(sparse=True)`) the values it holds, duplicates summed."""
    if t.layout is torch.strided:
        return t
    return t.coalesce().values() if t.layout is torch.sparse_coo else t.values()


def square_of(t: torch.Tensor) -> float:
    """‖t‖² as a Python number: one BLAS dot through numpy for a CPU float tensor, torch's
    norm for anything numpy cannot view. An overflow is an inf to report, and no warning:
    numpy's `vdot`, unlike its `dot` since numpy 2.4, does not check the floating-point
    flags. A sparse tensor's is its values' (`dense`)."""
    if t.layout is not torch.strided:
        t = dense(t)
    if t.dtype in _NUMPY:
        try:
            x = t.numpy()
        except (RuntimeError, TypeError):
            pass
        else:
            return float(np.vdot(x, x))  # (vdot flattens what it is given)
    n = float(torch.linalg.vector_norm(t.detach() if t.is_floating_point() else t.float()))
    return n * n


def squares_of(tensors: list[torch.Tensor]) -> list[float]:
    """‖t‖² of each: `square_of` each on the CPU; elsewhere one `_foreach_norm` and one read
    (one synchronisation on a GPU)."""
    if all(t.device.type == "cpu" for t in tensors):
        return [square_of(t) for t in tensors]
    return [v * v for v in read(list(torch._foreach_norm([dense(t.detach()) for t in tensors])))]


_CHUNK = 1 << 20  # the longest ones vector a sum is taken against (4 MB in float32)
_ONES: dict[Any, np.ndarray] = {}


def later_sums(v: np.ndarray, saturates: str | None, into: list[Any], at: int) -> None:
    """An output's sums, as an `Audit` takes them in the forward, from a flat numpy view of
    it: Σa (a BLAS dot against ones, in pieces of at most `_CHUNK`), then — for a place that
    saturates — how many values are saturated, then how many are zero (|a| ≤ 1e-7), written
    into `into` from `at`. An overflow is an inf to report, with no warning (`vdot`, `abs`
    and comparisons leave the floating-point flags alone). NaN is neither zero nor saturated,
    as in the forward's comparisons."""
    n = v.size
    ones = _ONES.get(v.dtype)
    want = min(n, _CHUNK)
    if ones is None or ones.size < want:
        ones = _ONES[v.dtype] = np.ones(max(want, 1 << 12), v.dtype)
    dot = np.vdot
    if n <= ones.size:
        total = float(dot(v, ones[:n]))
    else:
        pieces = range(0, n, _CHUNK)
        total = sum(float(dot(v[i : i + _CHUNK], ones[: min(_CHUNK, n - i)])) for i in pieces)
    count = np.count_nonzero
    magnitude = np.abs(v)
    into[at] = total
    if saturates == "sigmoid":
        at += 1
        into[at] = float(count((v <= _LOW) | (v >= _HIGH)))
    elif saturates == "tanh":
        at += 1
        into[at] = float(count(magnitude >= _HIGH))
    into[at + 1] = float(count(magnitude <= _DEAD_EPS))


def channel_view(t: torch.Tensor, conv: bool) -> torch.Tensor:
    """(samples, channels): channels on dim 1 for images, the last dim otherwise."""
    if t.dim() <= 1:
        return t.reshape(1, -1)
    if t.dim() == 2:
        return t
    if conv or t.dim() >= 4:
        return t.transpose(1, -1).reshape(-1, t.shape[1])
    return t.reshape(-1, t.shape[-1])


def cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two (samples, features) matrices; 0 when either does not vary."""
    x = x - x.mean(0, keepdim=True)
    y = y - y.mean(0, keepdim=True)
    xy = (y.T @ x).pow(2).sum()
    xx = (x.T @ x).pow(2).sum().sqrt()
    yy = (y.T @ y).pow(2).sum().sqrt()
    den = float(xx * yy)
    return float(xy) / den if den > 0 else 0.0


def effective_ranks(features: list[torch.Tensor]) -> list[float]:
    """exp of the entropy of the normalised singular values of each (rows, columns) matrix's
    centred rows (Roy & Vetterli), 0 for rows that do not vary. Matrices of one shape are
    taken together, in one batched eigendecomposition.

    From the eigenvalues of the smaller Gram matrix in float32 (the entropy then in float64);
    eigenvalues under what float32 rounding of that Gram matrix can tell from zero
    (λ_max · n · 4ε) count as zero, so a collapsed representation reads as collapsed rather
    than lifted by rounding noise. Within 1e-6 of the float64 answer on full-rank features
    (2e-8 on a ReLU 64×256 output); a spectrum reaching below that floor reads up to a few
    percent lower. A matrix with an inf or a NaN in it reads 0 (its eigenvalues are NaN), and
    the others of its batch are taken as usual.
    """
    return spectra(features, [])[0]


def effective_rank(f: torch.Tensor) -> float:
    """`effective_ranks` of one matrix."""
    return effective_ranks([f])[0]


def _entropy_rank(e: list[float]) -> float:
    """An effective rank from one Gram matrix's eigenvalues (ascending), floored as said in
    `effective_ranks`."""
    if not e or not 0 < e[-1] < math.inf:  # nothing varies (or not a number)
        return 0.0
    cut = e[-1] * (len(e) * _FLOOR)
    sqrt, log = math.sqrt, math.log
    kept = [x for x in e if x > cut]
    total = sum([sqrt(x) for x in kept])
    # −Σ p log p with p = σ/Σσ is log Σσ − Σ σ log σ / Σσ, and σ log σ = √λ · ½ log λ
    return total * math.exp(-0.5 * sum([sqrt(x) * log(x) for x in kept]) / total)


def _top_square(d: torch.Tensor, steps: int = _STEPS) -> float:
    """σ_max² of a 2-D matrix: exactly from the smaller Gram matrix
    when a side is at most `_EXACT`, else by power steps on the smaller side's Gram matrix A
    (`_power`), which settle when the update has one dominant direction, as a weight update
    usually has; and when they do not, by Lanczos on A (from a fixed start, every vector
    reorthogonalised against the ones before, σ_max² the top Ritz value θ of the projected
    matrix H = QᵀAQ).

    Lanczos stops early, after the steps in `_CHECKS`, when β·|s_last| ≤ `_TOL`·θ (s the unit
    eigenvector of H for θ, β the norm of the next residual): that is ‖Ay − θy‖ for the Ritz
    vector y = Qs, so some eigenvalue of A lies within `_TOL`·θ of θ (and θ ≤ λ_max always),
    the bound the power steps answer to too. A flat spectrum (a Gaussian matrix) runs all
    `steps`.

    On the CPU the same steps run on a numpy view of `d` (one BLAS call each, about a third of
    what a torch call costs at these sizes); elsewhere in torch, on `d`'s device."""
    rows, cols = d.shape
    if min(rows, cols) <= _EXACT:
        gram = d @ d.T if rows <= cols else d.T @ d
        return _eigenvalues(gram.unsqueeze(0))[0][-1]
    if rows < cols:
        d = d.T  # the vectors live on the smaller side
    try:
        if d.device.type == "cpu":
            x = d.numpy()
            zeros: Any = lambda *shape: np.zeros(shape, x.dtype)  # noqa: E731
            # an update that blew up (inf, NaN, or values whose products overflow) is a NaN
            # to report: no warning from numpy's matmul, and no failure to converge
            with np.errstate(all="ignore"):
                top = _power(x, zeros)
                return top if top is not None else _lanczos(x, zeros, np.linalg, steps)
        top = _power(d, d.new_zeros)
        return top if top is not None else _lanczos(d, d.new_zeros, torch.linalg, steps)
    except (np.linalg.LinAlgError, torch.linalg.LinAlgError):
        return math.nan


def _power(d: Any, zeros: Any) -> float | None:
    """σ_max² of a (rows ≥ cols) matrix by power steps on DᵀD from a fixed start, if they
    settle: after each step in `_POWER` the Rayleigh quotient θ = vᵀDᵀDv (v of unit length) is
    taken with its residual r = DᵀDv − θv, and θ is the answer once ‖r‖ ≤ `_TOL`·θ (some
    eigenvalue lies that close, and θ ≤ λ_max always). None when they have not settled by the
    last (a spectrum without one dominant direction), or when DᵀDv vanishes (no update, or
    one the start is blind to): Lanczos then takes it.

    A weight update usually has one dominant direction (σ₂/σ₁ ≈ 0.4 on the MLP of
    `bench/audit.py`) and settles at the first check: four steps of a few array operations
    each, against Lanczos's reorthogonalisation and small eigendecompositions."""
    n = d.shape[1]
    dt = d.T
    v = zeros(n)
    v += n**-0.5
    for k in range(1, _POWER[-1] + 1):
        w = dt @ (d @ v)
        if k in _POWER:
            theta = float(v @ w)
            if not theta > 0:  # the start meets no update (or not a number): Lanczos says
                return None
            r = w - theta * v
            if float(r @ r) <= (_TOL * theta) ** 2:
                return theta
        size = math.sqrt(float(w @ w))
        if not 0 < size < math.inf:
            return None
        v = w / size
    return None


def _lanczos(d: Any, zeros: Any, linalg: Any, steps: int = _STEPS) -> float:
    """`_top_square`'s Lanczos on a (rows ≥ cols) matrix, a numpy array or a torch tensor
    alike: it uses only what both have (`@`, indexing, `linalg.eigh`). `zeros(rows, cols)`
    makes an array of `d`'s kind, dtype and device."""
    n = d.shape[1]
    m = min(n, steps)
    dt = d.T
    basis = zeros(m, n)
    projected = zeros(m, m)  # row j: <DᵀD q_j, q_i>, i ≤ j (the lower triangle)
    basis[0] = n**-0.5
    k = m
    floor = 0.0
    for j in range(m):
        w = dt @ (d @ basis[j])
        # against the whole basis: the rows past j are still zero, so h is zero past j
        h = basis @ w
        projected[j] = h
        if j == m - 1:
            break
        w -= h @ basis
        b = math.sqrt(float(w @ w))
        if j == 0:
            floor = 1e-6 * float(h[0])
        if b <= floor:
            k = j + 1  # the Krylov space is whole: what is projected is exact
            break
        if j + 1 in _CHECKS:
            values, vecs = linalg.eigh(projected[: j + 1, : j + 1])
            top = float(values[-1])
            if b * abs(float(vecs[-1, -1])) <= _TOL * top:
                return top
        basis[j + 1] = w / b
    return float(linalg.eigvalsh(projected[:k, :k])[-1])


def stable_rank(d: torch.Tensor, frob: torch.Tensor | float | None = None) -> float:
    """‖D‖_F² / ‖D‖_2² of a weight update (flattened past its first dimension); 0 for no
    update, and for one that blew up (an inf or a NaN in it: its σ_max² is NaN). `frob`,
    ‖D‖_F when it is already known."""
    top = spectra([], [d])[1][0]
    if frob is None:
        d = d.detach()
        frob = torch.linalg.vector_norm(
            d if d.is_floating_point() and d.itemsize >= 4 else d.float()
        )
    return stable_of(float(frob), top)


def stable_of(frob: float, top: float) -> float:
    """‖D‖_F² / σ_max², 0 when there is no update (or its σ_max² is not a number)."""
    return frob * frob / top if top > 0 else 0.0


def _eigenvalues(grams: torch.Tensor) -> list[list[float]]:
    """The eigenvalues (ascending) of each of a batch of Gram matrices. A matrix with an inf
    or a NaN in it (an output or an update that blew up) gets NaNs, which read as no rank,
    rather than LAPACK's failure to converge stopping the step it is audited in."""
    try:
        return torch.linalg.eigvalsh(grams).tolist()
    except torch.linalg.LinAlgError:
        nan = [math.nan] * grams.shape[-1]
        return [
            torch.linalg.eigvalsh(g).tolist() if bool(torch.isfinite(g).all()) else nan
            for g in grams
        ]


def spectra(
    features: list[torch.Tensor], updates: list[torch.Tensor]
) -> tuple[list[float], list[float]]:
    """The effective rank of each (rows, columns) feature matrix and σ_max² of each update.

    Every Gram matrix of one size, an effective rank's or an exact σ_max²'s, goes through one
    batched `eigvalsh`, and feature matrices of one shape are centred and multiplied together;
    an update whose smaller side passes `_EXACT` goes to Lanczos (`_top_square`)."""
    pool: dict[tuple[int, torch.device], list[tuple[list[tuple[bool, int]], torch.Tensor]]] = {}
    ranks = [0.0] * len(features)
    tops = [0.0] * len(updates)
    shapes: dict[tuple, list[int]] = {}
    for i, f in enumerate(features):
        shapes.setdefault((tuple(f.shape), f.device), []).append(i)
    for (shape, device), idx in shapes.items():
        f = (
            features[idx[0]].unsqueeze(0)
            if len(idx) == 1
            else torch.stack([features[i] for i in idx])
        )
        if f.dtype is not torch.float32:
            f = f.float()
        f = f - f.mean(1, keepdim=True)
        gram = f @ f.mT if shape[0] <= shape[1] else f.mT @ f
        pool.setdefault((gram.shape[-1], device), []).append(([(True, i) for i in idx], gram))
    for j, d in enumerate(updates):
        if d.requires_grad:
            d = d.detach()
        if d.layout is not torch.strided:  # a sparse gradient, which an SGD update is lr times
            d = d.to_dense()
        if d.dim() != 2:
            d = d.reshape(d.shape[0], -1)
        if d.dtype is not torch.float32 and d.dtype is not torch.float64:
            d = d.float()
        if min(d.shape) > _EXACT:
            tops[j] = _top_square(d)
            continue
        gram = (d @ d.T if d.shape[0] <= d.shape[1] else d.T @ d).float()
        pool.setdefault((gram.shape[0], d.device), []).append(([(False, j)], gram.unsqueeze(0)))
    for entries in pool.values():
        grams = [g for _, g in entries]
        rows = iter(_eigenvalues(grams[0] if len(grams) == 1 else torch.cat(grams)))
        for who, _ in entries:
            for rank, i in who:
                row = next(rows)
                if rank:
                    ranks[i] = _entropy_rank(row)
                else:
                    tops[i] = row[-1]
    return ranks, tops
