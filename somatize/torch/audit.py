"""Watching a graph while it trains: `Audit`.

One `health` fact per watched place and measured step, keyed by `node` or
`node.path.to.submodule`; `somatize.health` turns what was recorded into verdicts. What is
measured where:

- every place with parameters: grad_norm, param_norm, update_ratio (‖θ_t − θ_{t−1}‖/‖θ_{t−1}‖
  between consecutive observed steps);
- every place's output: act_mean, zero and saturated fractions (the max over the last `window`
  measured steps), out_grad_norm (‖∂L/∂output‖, from a tensor hook), nan and inf;
- on snapshot steps: effective_rank of the output (and rank_room, the most it could be), and
  update_stable_rank of the place's largest weight;
- with `channels`: channels, dead_channels (never active over the window), dormant_channels
  (activity under a tenth of the layer's mean this step);
- with `groups`: cka, the largest linear CKA between two declared channel groups.

Forward hooks and tensor hooks only, never full backward hooks (those break on in-place ReLU).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from somatize.torch._state import Tap, as_graph, join, named_modules_of, tensors_in
from somatize.torch.kinds import kind_of

__all__ = ["Audit"]

_DEAD_EPS = 1e-7
_DORMANT_TAU = 0.1
_ROWS = 1024


def _saturation(modules: list[nn.Module]) -> str | None:
    """How this place saturates, read off the last activation it holds."""
    for m in reversed(modules):
        if kind_of(m) == "activation" and next(m.children(), None) is None:
            names = [c.__name__ for c in type(m).__mro__]
            if any("Sigmoid" in n for n in names):
                return "sigmoid"
            if any(n in ("Tanh", "Hardtanh", "Softsign") for n in names):
                return "tanh"
            return None
    return None


class _Place:
    __slots__ = (
        "where",
        "params",
        "saturates",
        "conv",
        "zero",
        "saturated",
        "alive",
        "out_grad",
        "features",
        "index",
        "sums",
        "groups",
    )

    def __init__(self, where: str, modules: list[nn.Module], window: int) -> None:
        self.where = where
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    self.params.append(p)
        every = [s for m in modules for s in m.modules()]
        self.saturates = _saturation(every)
        self.conv = any(kind_of(s) == "conv" for s in every)
        self.zero: deque[float] = deque(maxlen=window)
        self.saturated: deque[float] = deque(maxlen=window)
        self.alive: deque[torch.Tensor] = deque(maxlen=window)
        self.out_grad: torch.Tensor | None = None
        self.features: torch.Tensor | None = None
        self.index: list[int] = []  # where its parameters sit in the audit's flat list
        self.sums: tuple[int, int, bool] | None = None  # this step's slots in the audit's sums
        self.groups: dict[str, list[int]] | None = None


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """Many one-number tensors as Python floats, with one device sync per dtype at most."""
    if not tensors:
        return []
    if tensors[0].device.type == "cpu":
        return [float(t) for t in tensors]  # a CPU read is a copy, cheaper than a stack
    by: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault(t.dtype, []).append(i)
    out = [0.0] * len(tensors)
    for idx in by.values():
        for i, v in zip(idx, torch.stack([tensors[i] for i in idx]).tolist(), strict=True):
            out[i] = float(v)
    return out


def _channel_view(t: torch.Tensor, conv: bool) -> torch.Tensor:
    """(samples, channels): channels on dim 1 for images, the last dim otherwise."""
    if t.dim() <= 1:
        return t.reshape(1, -1)
    if t.dim() == 2:
        return t
    if conv or t.dim() >= 4:
        return t.transpose(1, -1).reshape(-1, t.shape[1])
    return t.reshape(-1, t.shape[-1])


def _cka(x: torch.Tensor, y: torch.Tensor) -> float:
    x = x - x.mean(0, keepdim=True)
    y = y - y.mean(0, keepdim=True)
    xy = (y.T @ x).pow(2).sum()
    xx = (x.T @ x).pow(2).sum().sqrt()
    yy = (y.T @ y).pow(2).sum().sqrt()
    den = float(xx * yy)
    return float(xy) / den if den > 0 else 0.0


def _effective_rank(f: torch.Tensor) -> tuple[float, int]:
    """exp of the entropy of the normalised singular values (Roy & Vetterli), from the
    eigenvalues of the smaller Gram matrix."""
    f = f - f.mean(0, keepdim=True)
    gram = f @ f.T if f.shape[0] <= f.shape[1] else f.T @ f
    s = torch.linalg.eigvalsh(gram).clamp(min=0).sqrt()
    total = float(s.sum())
    room = min(f.shape)
    if total <= 0:
        return 0.0, room
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum())), room


def _top_square(d: torch.Tensor, steps: int = 12) -> float:
    """σ_max² of a 2-D float64 matrix: exactly from the smaller Gram matrix when one side is
    short, else by Lanczos on DᵀD (fully reorthogonalised, from a fixed start)."""
    rows, cols = d.shape
    if min(rows, cols) <= 128:
        gram = d @ d.T if rows <= cols else d.T @ d
        return float(torch.linalg.eigvalsh(gram)[-1])
    m = min(cols, steps)
    basis = torch.zeros(m, cols, dtype=d.dtype)
    q = torch.full((cols,), cols**-0.5, dtype=d.dtype)
    alphas: list[torch.Tensor] = []
    betas: list[float] = []
    for j in range(m):
        basis[j] = q
        w = d.T @ (d @ q)
        alphas.append(w @ q)
        seen = basis[: j + 1]
        w = w - seen.T @ (seen @ w)
        b = float(w.norm())
        if j == m - 1 or b <= 1e-12 * max(1.0, abs(float(alphas[0]))):
            break
        betas.append(b)
        q = w / b
    k = len(alphas)
    t = torch.diag(torch.stack(alphas))
    if k > 1:
        off = torch.tensor(betas[: k - 1], dtype=d.dtype)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    return float(torch.linalg.eigvalsh(t)[-1])


def _stable_rank(d: torch.Tensor) -> float:
    """‖D‖_F² / ‖D‖_2² of a weight update (flattened past its first dimension)."""
    d = d.reshape(d.shape[0], -1).double()
    frob = float(d.pow(2).sum())
    if frob == 0:
        return 0.0
    top = _top_square(d)
    return frob / top if top > 0 else 0.0


class Audit:
    """Watches the nodes of a graph and says what it saw. Built by the Trainer when
    `auditing=` is given; little reason to make one by hand except to choose a cadence or to
    declare groups, the channel partitions a node keeps apart::

        Trainer(g, ..., auditing=Audit(every=10, channels=True))
        Audit(groups={"encoder": {"audio": range(0, 64), "text": range(64, 128)}})

    `every`: measure one step in this many. `snapshot`: the costlier numbers (effective rank,
    update stable rank) every this many steps. `window`: the steps zero and saturated fractions
    and dead channels are taken over. `inside`: also watch what is in each node — True for
    every leaf module, an int for modules down to that depth, or a list of places
    (`"node.path"`); at most `most` per node. Refuses a cadence under 1 and groups that are not
    channel indices.
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
        self._graph: Any = None
        self._places: dict[str, _Place] = {}
        self._handles: list[Any] = []
        self._inner_hooks: list[tuple[nn.Module, Any]] = []
        self._tap: Tap | None = None
        self._measuring = False
        self._flat: list[nn.Parameter] = []
        self._prev: list[torch.Tensor] | None = None
        self._prev_ok = False
        self._prev_sq: list[float] = []
        self._sums: list[torch.Tensor] = []

    def __repr__(self) -> str:
        watching = f", watching {len(self._places)} places" if self._graph is not None else ""
        return f"Audit(every={self.every}, step={self.step}{watching})"

    # -- which places ---------------------------------------------------------------------
    def _inner(self, node: str, held: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        inside = self.inside
        if inside is None or inside is False:
            return []
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
                    keep = f"{node}.{full}" in set(inside)
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
        self._prev_ok = False
        self._places = places
        self._inner_hooks = inner
        self._graph = g
        self._tap = Tap(g, self._node).on()
        self._arm(self.step % self.every == 0)
        return self

    def _arm(self, measuring: bool) -> None:
        """Forward hooks inside nodes are there only for a step that is measured: a module
        with no hooks takes torch's fast path, so unmeasured steps pay nothing for them."""
        self._measuring = measuring
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
        self._prev = None
        self._prev_ok = False
        self._sums = []

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
        tensors = [t for t in tensors_in(out) if t.is_floating_point()]
        if not tensors:
            return
        t = tensors[0]
        a = t.detach()
        magnitude = a.abs()
        sums = self._sums
        at = len(sums)
        sums.append(magnitude.sum())
        sums.append(a.sum())
        sums.append((magnitude <= _DEAD_EPS).sum())
        if place.saturates == "sigmoid":
            sums.append(((a <= 0.01) | (a >= 0.99)).sum())
        elif place.saturates == "tanh":
            sums.append((magnitude >= 0.99).sum())
        place.sums = (at, a.numel() or 1, place.saturates is not None)
        if t.requires_grad:
            place.out_grad = None

            def grad_hook(g: torch.Tensor) -> None:
                place.out_grad = g.detach()

            t.register_hook(grad_hook)
        if self.channels or place.groups or self._snapshot_now():
            place.features = _channel_view(a, place.conv)

    def _snapshot_now(self) -> bool:
        return self.step % self.snapshot == 0

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
        facts: list[dict[str, Any]] = []
        measured = step % self.every == 0
        squares: list[float] = []
        if measured:
            snapshot = self._snapshot_now()
            found, squares = self._measure(snapshot)
            for place, numbers in found:
                if numbers:
                    facts.append(
                        {"fact": "health", "where": place.where, "step": step, "numbers": numbers}
                    )
            for place in self._places.values():
                place.sums = None
                place.out_grad = None
                place.features = None
            self._sums = []
        if (step + 1) % self.every == 0 and self._flat:
            # θ before the optimizer moves it, for the next measured step's update ratio, and
            # its norms (this step's, when this step was measured: the same numbers)
            with torch.no_grad():
                params = [q.detach() for q in self._flat]
                if self._prev is None:
                    self._prev = [q.clone() for q in params]
                else:
                    torch._foreach_copy_(self._prev, params)
                if not measured:
                    squares = [v * v for v in _read(list(torch._foreach_norm(params)))]
            self._prev_sq = squares
            self._prev_ok = True
        elif measured:
            self._prev_ok = False  # spent: the next measured step copies afresh
        self.step = step + 1
        self._arm(self.step % self.every == 0)
        return facts

    def _measure(self, snapshot: bool) -> tuple[list[tuple[_Place, dict[str, Any]]], list[float]]:
        """Every place's numbers for this step, from one pass of norms and one read; and the
        squared norm of each parameter (kept as ‖θ_{t−1}‖ for the next update ratio)."""
        flat = self._flat
        places = list(self._places.values())
        with torch.no_grad():
            params = [q.detach() for q in flat]
            grad_at: dict[int, int] = {}
            grads: list[torch.Tensor] = []
            for i, q in enumerate(flat):
                if q.grad is not None:
                    grad_at[i] = len(grads)
                    grads.append(q.grad)
            prev = self._prev if self._prev_ok else None
            outs = [p.out_grad for p in places if p.out_grad is not None]
            first = params + grads + outs
            norms = list(torch._foreach_norm(first)) if first else []
            if prev is not None:
                torch._foreach_sub_(prev, params)  # prev is now −Δθ; refilled after
                norms += torch._foreach_norm(prev)
            norms += self._sums
            values = _read(norms)
        square = [v * v for v in values]
        at_grad = len(params)
        at_out = at_grad + len(grads)
        at_delta = at_out + len(outs)
        before_sq = self._prev_sq
        at_sums = at_delta + (len(prev) if prev is not None else 0)
        out_k = 0
        found = []
        for place in places:
            n: dict[str, Any] = {}
            if place.index:
                index = place.index
                n["param_norm"] = math.sqrt(sum(square[i] for i in index))
                mine = [at_grad + grad_at[i] for i in index if i in grad_at]
                if mine:
                    g = math.sqrt(sum(square[k] for k in mine))
                    n["grad_norm"] = g
                    n["nan"] = math.isnan(g)
                    n["inf"] = math.isinf(g)
                if prev is not None:
                    before = math.sqrt(sum(before_sq[i] for i in index))
                    delta = math.sqrt(sum(square[at_delta + i] for i in index))
                    n["update_ratio"] = delta / before if before > 0 else 0.0
                    if snapshot:
                        big = max(index, key=lambda i: flat[i].numel())
                        if prev[big].dim() >= 2:
                            n["update_stable_rank"] = _stable_rank(prev[big])
            if place.sums is not None:
                k, size, saturates = place.sums
                total = values[at_sums + k]
                n["act_mean"] = values[at_sums + k + 1] / size
                place.zero.append(values[at_sums + k + 2] / size)
                place.saturated.append(values[at_sums + k + 3] / size if saturates else 0.0)
                n["zero"] = max(place.zero)
                n["saturated"] = max(place.saturated)
                n["nan"] = bool(n.get("nan", False) or math.isnan(total))
                n["inf"] = bool(n.get("inf", False) or math.isinf(total))
                if place.out_grad is not None:
                    n["out_grad_norm"] = values[at_out + out_k]
                f = place.features
                if f is not None:
                    with torch.no_grad():
                        if snapshot and f.shape[0] > 1:
                            rows = f if f.dim() == 2 else f.reshape(f.shape[0], -1)
                            rank, room = _effective_rank(rows[:_ROWS].double())
                            n["effective_rank"] = rank
                            n["rank_room"] = room
                        if self.channels:
                            self._channels(place, f, n)
                        if place.groups:
                            n["cka"] = self._groups(place, f)
            if place.out_grad is not None:
                out_k += 1
            found.append((place, n))
        return found, square[:at_grad]

    def _channels(self, place: _Place, f: torch.Tensor, n: dict[str, Any]) -> None:
        activity = f.abs().mean(0)
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
                best = max(best, _cka(rows[:, a], rows[:, b]))
        return best if math.isfinite(best) else 0.0
