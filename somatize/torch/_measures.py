"""The numbers an `Audit` takes on a snapshot step, and the channel views it takes them on.

Everything here answers tensors, not Python numbers, so the audit reads every number of a step
in one go.
"""

from __future__ import annotations

import torch

__all__ = [
    "channel_view",
    "cka",
    "effective_rank",
    "effective_ranks",
    "read",
    "snapshot",
    "stable_rank",
]

# the smaller side up to which σ_max is taken exactly, from the eigenvalues of the Gram matrix;
# past it, by at most this many Lanczos steps, stopping early (checked after the steps in
# `_CHECKS`) once the top Ritz pair's residual is under `_TOL` of its value
_EXACT = 96
_STEPS = 12
_CHECKS = (4, 8)
_TOL = 1e-3
_FLOOR = 4 * torch.finfo(torch.float32).eps


def read(tensors: list[torch.Tensor]) -> list[float]:
    """Many one-number tensors as Python floats: one stack and one `.tolist()` (one per
    device when they are spread over several)."""
    if not tensors:
        return []
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


def effective_ranks(features: list[torch.Tensor]) -> list[torch.Tensor]:
    """exp of the entropy of the normalised singular values of each (rows, columns) matrix's
    centred rows (Roy & Vetterli), each a one-number tensor (0 for rows that do not vary).
    Matrices of one shape are taken together, in one batched eigendecomposition.

    From the eigenvalues of the smaller Gram matrix in float32; eigenvalues under what float32
    rounding of that Gram matrix can tell from zero (λ_max · n · 4ε) count as zero, so a
    collapsed representation reads as collapsed rather than lifted by rounding noise. Within
    1e-4 of the float64 answer on full-rank features; a spectrum reaching below that floor
    reads up to a few percent lower.
    """
    groups: dict[tuple, list[int]] = {}
    for i, f in enumerate(features):
        groups.setdefault((tuple(f.shape), f.device), []).append(i)
    out: list[torch.Tensor] = [torch.zeros(())] * len(features)
    for (shape, _), idx in groups.items():
        f = (
            features[idx[0]].unsqueeze(0)
            if len(idx) == 1
            else torch.stack([features[i] for i in idx])
        )
        if f.dtype is not torch.float32:
            f = f.float()
        f = f - f.mean(1, keepdim=True)
        gram = f @ f.mT if shape[0] <= shape[1] else f.mT @ f
        ranks = _entropy_ranks(torch.linalg.eigvalsh(gram))
        for i, r in zip(idx, ranks.unbind(0), strict=True):
            out[i] = r
    return out


def effective_rank(f: torch.Tensor) -> torch.Tensor:
    """`effective_ranks` of one matrix."""
    return effective_ranks([f])[0]


def _top_square(d: torch.Tensor, steps: int = _STEPS) -> torch.Tensor:
    """σ_max² of a 2-D matrix as a one-number tensor: exactly from the smaller Gram matrix
    when a side is at most `_EXACT`, else by Lanczos on the smaller side's Gram matrix A (from a
    fixed start, every vector reorthogonalised against the ones before, σ_max² the top Ritz
    value θ of the projected matrix H = QᵀAQ).

    After the steps in `_CHECKS` it stops early when β·|s_last| ≤ `_TOL`·θ (s the unit
    eigenvector of H for θ, β the norm of the next residual): that is ‖Ay − θy‖ for the Ritz
    vector y = Qs, so some eigenvalue of A lies within `_TOL`·θ of θ (and θ ≤ λ_max always).
    A weight update usually has one dominant direction and stops at the first check; a flat
    spectrum (a Gaussian matrix) runs all `steps`."""
    rows, cols = d.shape
    if min(rows, cols) <= _EXACT:
        gram = d @ d.T if rows <= cols else d.T @ d
        return torch.linalg.eigvalsh(gram)[-1]
    if rows < cols:
        d = d.T  # the vectors live on the smaller side
    n = d.shape[1]
    m = min(n, steps)
    dt = d.T
    basis = d.new_zeros(m, n)
    projected = d.new_zeros(m, m)  # row j: <D^T D q_j, q_i> for i <= j (the lower triangle)
    vectors = basis.unbind(0)
    rows = projected.unbind(0)
    vectors[0].fill_(n**-0.5)
    k = m
    floor = 0.0
    for j in range(m):
        w = torch.mv(dt, torch.mv(d, vectors[j]))
        seen = basis[: j + 1]
        h = torch.mv(seen, w, out=rows[j][: j + 1])
        if j == m - 1:
            break
        w = torch.addmv(w, seen.T, h, alpha=-1)
        b = float(torch.linalg.vector_norm(w))
        if j == 0:
            floor = 1e-6 * float(h[0])
        if b <= floor:
            k = j + 1  # the Krylov space is whole: what is projected is exact
            break
        if j + 1 in _CHECKS:
            values, vecs = torch.linalg.eigh(projected[: j + 1, : j + 1])
            top, last = torch.stack((values[-1], vecs[-1, -1])).tolist()
            if b * abs(last) <= _TOL * top:
                return values[-1]
        torch.div(w, b, out=vectors[j + 1])
    return torch.linalg.eigvalsh(projected[:k, :k])[-1]


def stable_rank(d: torch.Tensor, frob: torch.Tensor | None = None) -> torch.Tensor:
    """‖D‖_F² / ‖D‖_2² of a weight update (flattened past its first dimension), as a
    one-number tensor; 0 for no update. `frob`, ‖D‖_F when it is already known."""
    d = d.detach().reshape(d.shape[0], -1)
    if d.dtype is not torch.float32 and d.dtype is not torch.float64:
        d = d.float()
    if frob is None:
        frob = torch.linalg.vector_norm(d)
    top = _top_square(d)
    return torch.where(top > 0, frob.to(top.dtype).square() / top, 0.0)


def _entropy_ranks(e: torch.Tensor) -> torch.Tensor:
    """Effective ranks from rows of Gram eigenvalues (ascending), floored as said above."""
    e = torch.where(e > e[:, -1:] * (e.shape[-1] * _FLOOR), e, 0.0).sqrt_()
    total = e.sum(1, keepdim=True)
    p = e / torch.where(total > 0, total, 1.0)
    return torch.where(total[:, 0] > 0, torch.special.entr(p).sum(1).exp(), 0.0)


def snapshot(
    features: list[torch.Tensor], updates: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`effective_ranks(features)` and `stable_rank(d, frob)` of each update, together: every
    Gram matrix of one size, whichever asked for it, goes through one batched
    eigendecomposition (a snapshot step pays per size, not per number)."""
    pool: dict[tuple[int, torch.device], list[tuple[bool, int, torch.Tensor]]] = {}
    ranks: list[torch.Tensor] = [torch.zeros(())] * len(features)
    stable: list[torch.Tensor] = [torch.zeros(())] * len(updates)
    for i, f in enumerate(features):
        if f.dtype is not torch.float32:
            f = f.float()
        f = f - f.mean(0, keepdim=True)
        gram = f @ f.T if f.shape[0] <= f.shape[1] else f.T @ f
        pool.setdefault((gram.shape[0], gram.device), []).append((True, i, gram))
    frobs: dict[int, torch.Tensor] = {}
    for j, (d, frob) in enumerate(updates):
        d = d.detach().reshape(d.shape[0], -1)
        if d.dtype is not torch.float32 and d.dtype is not torch.float64:
            d = d.float()
        if min(d.shape) > _EXACT:
            stable[j] = stable_rank(d, frob)
            continue
        gram = (d @ d.T if d.shape[0] <= d.shape[1] else d.T @ d).float()
        frobs[j] = frob
        pool.setdefault((gram.shape[0], gram.device), []).append((False, j, gram))
    for entries in pool.values():
        grams = [g for _, _, g in entries]
        e = torch.linalg.eigvalsh(grams[0].unsqueeze(0) if len(grams) == 1 else torch.stack(grams))
        rows = [k for k, (rank, _, _) in enumerate(entries) if rank]
        if rows:
            took = _entropy_ranks(e if len(rows) == len(entries) else e[rows])
            for k, r in zip(rows, took.unbind(0), strict=True):
                ranks[entries[k][1]] = r
        tops = [k for k, (rank, _, _) in enumerate(entries) if not rank]
        if tops:
            top = e[tops, -1].double()
            frob = torch.stack([frobs[entries[k][1]] for k in tops]).double()
            sr = torch.where(top > 0, frob.square() / top, 0.0)
            for k, s in zip(tops, sr.unbind(0), strict=True):
                stable[entries[k][1]] = s
    return ranks, stable
