"""Cheap scores for a candidate before anybody trains it: `proxy`, `proxies`, `EVERY`.

Each is a zero-cost proxy from the literature, taken on the whole graph as it runs:

- synflow: Σ |θ·∂R/∂θ| with every weight replaced by its magnitude, in float64, batch norm
  off, R the sum of the output on an all-ones input (Tanaka et al. 2020). Logarithm. A net
  that will not run in float64 (a float32-only kernel, as in transformers' mixture of
  experts; a NaN where float64 meets a float32 constant) is scored in float32.
- zen: log E_i Σ_j |f(x)_ij − f(x + αε)_ij| + Σ_BN ½ log mean_c σ²_c, x and ε standard
  normal, α = 0.01, σ²_c the batch variance of what reaches each batch norm (Lin et al. 2021).
  Not taken where the output is not computed from what it perturbs (a float attention mask);
  −∞ (log 0, the worst) where it is and does not move (every unit dead).
- naswot: log |det K| with K_ij = c_i·c_j + (1−c_i)·(1−c_j), c_i the binary code of which
  activation outputs are positive for sample i (Mellor et al. 2021).
- jacob_cov: −Σ_k log(λ_k + 1e-5) + 1/(λ_k + 1e-5), λ the eigenvalues of the correlation
  matrix of the per-sample input gradients of the summed output (Mellor et al. 2020); gradients
  that are all zero (every unit dead) are scored as such, the worst there is.
- snip: Σ |θ·∂L/∂θ| (Lee et al. 2019). Logarithm.
- grasp: −Σ θ·(H ∂L/∂θ), H the Hessian of the loss (Wang et al. 2020). As is: it has a sign.
  Attention runs through torch's math kernel of `scaled_dot_product_attention` here: the
  fused kernels (flash, memory-efficient) have no second derivative.
- grad_norm: ‖∂L/∂θ‖₂ over every parameter. Logarithm.
- fisher: Σ_layers Σ_c ½ mean_i (Σ_spatial a·∂L/∂a)², a the output of every conv and
  learned layer (Theis et al. 2018). Logarithm.

The last four read a loss. Every proxy runs on its own seeded generator, in the same modes
whatever mode the net was left in (evaluation for every module, batch statistics for batch
norm), and the net is left exactly as it was: weights, gradients, modes, buffers and the global
random state.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from somatize.graph import as_graph
from somatize.node import unwrap
from somatize.run import in_one_line, note, warn
from somatize.torch._modules import Held, Tap, join, parts_of, root_of, tensors_in, untouched
from somatize.torch._values import mapped
from somatize.torch.audit._measures import floats_in
from somatize.torch.audit._place import looking
from somatize.torch.inside.architecture import given, run_here
from somatize.torch.inside.kinds import BATCH_NORMS, kind_of

__all__ = ["EVERY", "ProxyLeftOut", "proxy", "proxies"]


class ProxyLeftOut(UserWarning):
    """The warning `proxies` gives for a proxy it could not take on a graph and left out of
    its answer: `proxy` names it, `why` says why and `candidate` names the candidate when
    `compare` gives it, so a caller can read them or filter these warnings alone
    (`warnings.simplefilter("ignore", ProxyLeftOut)`)."""

    def __init__(self, proxy: str, why: str, candidate: str | None = None) -> None:
        said = f"proxies: {proxy} could not be taken on this graph and is left out ({why})"
        super().__init__(said if candidate is None else f"candidate {candidate!r}: {said}")
        self.proxy, self.why, self.candidate = proxy, why, candidate


_LOSS = frozenset({"snip", "grasp", "grad_norm", "fisher"})


class _NotHere(ValueError):
    """This proxy cannot be taken on this graph with this example."""


def _why(error: Exception) -> str:
    """Why a proxy was not taken, in one line: a `_NotHere` says it itself (one line already),
    anything else by its class, its message's first line and its notes (the node it ran)."""
    if isinstance(error, _NotHere):
        return str(error)
    return "; ".join([in_one_line(error), *getattr(error, "__notes__", ())])


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf if x == 0 else math.nan  # (nan: left out)


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every floating tensor in it, every container kept as it
    is (a `PackedSequence`, a `BatchEncoding`); the rest as it is."""
    return mapped(value, lambda t: fn(t) if t.is_floating_point() else t)


def _floats(example: Any, of: str) -> list[torch.Tensor]:
    found = floats_in(example)
    if not found:
        raise _NotHere(f"{of} perturbs the input, and this example holds no floating tensor")
    return found


def _named_floats(example: Any) -> str:
    """Which floating tensors an example holds, said for a message: a dict's keys."""
    if isinstance(example, Mapping):
        return ", ".join(str(k) for k, v in example.items() if floats_in(v))
    return "the input"


class _Subject:
    """The graph, its modules and parameters, made ready for one proxy."""

    def __init__(self, graph: Any) -> None:
        self.graph = as_graph(graph)
        self.roots = {n: root_of(self.graph.implementation(n)) for n in self.graph.nodes()}
        kept = {n: m for n, m in self.roots.items() if m is not None}
        self.held = Held(list(kept.values()), list(kept))
        self.held.refuse(reads="proxies")  # the net, not one proxy: refused, not left out
        self.params = self.held.params

    def name(self, module: nn.Module) -> str:
        """Where `module` is in the graph, said for a message: `node.path.to.it`."""
        for node, root in self.roots.items():
            for path, m in root.named_modules() if root is not None else ():
                if m is module:
                    return repr(join(node, path))
        return type(module).__name__

    def quiet(self) -> None:
        """Every module in evaluation mode but batch norm (batch statistics), nothing in
        place, every parameter differentiable and without a gradient yet."""
        self.held.differentiable()
        for m in self.held.modules:
            m.training = isinstance(m, BATCH_NORMS)
        for p in self.params:
            p.grad = None

    def run(self, x: Any) -> list[torch.Tensor]:
        """The tensors of the graph's output, a loss given first passed over, run here (a node
        `.at(host)` from its copy here)."""
        out = given(self.graph, run_here(self.graph, x))
        if not out:
            raise _NotHere("the graph gave back no tensor to score")
        return out

    def hooked(self, of: str, kinds: tuple[str, ...], fn: Callable) -> Any:
        """`fn` a forward hook on every layer of these kinds while inside; the proxy `of`
        cannot be taken where there is none."""
        layers = [m for m in self.held.modules if not parts_of(m) and kind_of(m) in kinds]
        if not layers:
            if "activation" in kinds:
                raise _NotHere(_NO_ACTIVATION % (of, "this graph holds none"))
            raise _NotHere(f"{of} reads {' and '.join(kinds)} layers, and this graph has none")
        return _hooked(layers, fn)


_NO_ACTIVATION = (
    "%s reads the activation layers held as modules (nn.ReLU, nn.GELU, ...), and %s: an "
    "activation called as a function (F.relu, torch.gelu, x.relu()), a box in the figure all "
    "the same, is not hooked (a Mamba of transformers computes F.silu beside the act it "
    "holds); hold it as a module and call it (self.act = nn.ReLU(); self.act(x)) to take it"
)


def _hooked(modules: list[nn.Module], fn: Callable) -> contextlib.ExitStack:
    """`fn` a forward hook on each of `modules` while inside."""
    hooks = contextlib.ExitStack()
    for m in modules:
        hooks.enter_context(m.register_forward_hook(fn))  # (a handle removes it on exit)
    return hooks


def _loss(s: _Subject, example: Any, target: Any, objective: Callable) -> torch.Tensor:
    out = run_here(s.graph, example)
    try:
        loss = objective(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            gave = f"{tuple(loss.shape)} tensor" if torch.is_tensor(loss) else type(loss).__name__
            raise ValueError(f"it gave a {gave}, not a scalar tensor (reduce it: .mean())")
    except Exception as e:  # the objective's fault, not the graph's: said so
        note(e, "while computing the loss, objective(output, target)")
        raise
    return loss


def _grads(loss: torch.Tensor, params: list[nn.Parameter], **kw: Any) -> list[torch.Tensor]:
    got = torch.autograd.grad(loss, params, allow_unused=True, **kw)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, got, strict=True)]


def _synflow(s: _Subject, example: Any, **_: Any) -> float:
    why: list[Exception] = []
    for dtype in (torch.float64, torch.float32):
        try:
            return _synflow_in(s, example, dtype)
        except Exception as e:  # noqa: BLE001  (a net that will not run in it: told below)
            why.append(e)
    if isinstance(why[1], _NotHere):
        raise why[1]  # it ran in float32 and gave no score: it says why, and where
    raise _NotHere(
        f"synflow ran the net neither in float64 ({_why(why[0])}) nor in float32 ({_why(why[1])})"
    )


def _synflow_in(s: _Subject, example: Any, dtype: torch.dtype) -> float:
    for m in s.held.roots:
        m.to(dtype)  # buffers too, so nothing meets a tensor of another precision
    for p in s.params:
        p.data = p.data.abs()  # (.data: no autograd)
    bn = [m for m in s.held.modules if isinstance(m, BATCH_NORMS)]
    for m in bn:
        object.__setattr__(m, "forward", lambda x, *_, **__: x)  # batch norm off
    broke: list[str] = []  # the first node that gave a nan or an inf

    def seen(node: str, given: Any, ctx: Any, out: Any) -> None:
        if not broke and not all(bool(t.isfinite().all()) for t in floats_in(out)):
            broke.append(node)

    try:
        ones = _map(example, lambda t: torch.ones_like(t, dtype=dtype))
        with Tap(s.graph, seen):
            r = sum(t.to(dtype).sum() for t in s.run(ones))
        grads = _grads(r, s.params)
    finally:
        for m in bn:
            object.__delattr__(m, "forward")
    score = sum(float((p.detach() * g).abs().sum()) for p, g in zip(s.params, grads, strict=True))
    if not math.isfinite(score):
        where = f"node {broke[0]!r} gave" if broke else "the score is"
        raise _NotHere(_SYNFLOW_NAN % (where, score))
    return _log(score)


_SYNFLOW_NAN = (
    "synflow runs the net on an input of ones, every weight made positive, and %s %s there "
    "(a standardisation (x - mean) / std divides by the zero std of a constant input; a "
    "product of large weights overflows): synflow cannot be taken on this graph"
)


def _zen(s: _Subject, example: Any, *, gen: torch.Generator, **_: Any) -> float:
    floats = _floats(example, "zen")
    x = _map(example, lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype))
    mixed = _map(x, lambda t: t + 0.01 * torch.randn(t.shape, generator=gen, dtype=t.dtype))
    variances: list[float] = []

    def bn_in(m: nn.Module, i: tuple, o: Any) -> None:
        t = i[0]
        dims = [d for d in range(t.dim()) if d != 1]
        variances.append(float(t.var(dim=dims, unbiased=False).mean()))

    with torch.no_grad():
        with _hooked([m for m in s.held.modules if isinstance(m, BATCH_NORMS)], bn_in):
            f1 = s.run(x)
        f2 = s.run(mixed)
    total = sum(
        float(((a - b).abs().flatten(1).sum(1) if a.dim() > 1 else (a - b).abs()).mean())
        for a, b in zip(f1, f2, strict=True)
    )
    if total == 0 and any(g is not None for g in _input_grads(s, example, floats)):
        return -math.inf  # log 0: the output is computed from the input and does not move
    if total == 0:  # log 0: what it moved is not what the output is computed from
        raise _NotHere(
            f"zen moves the example's floating tensors ({_named_floats(example)}) and the "
            "output did not move with them (a float mask is read as a mask): there is no "
            "floating input to perturb, so zen cannot be taken on this example"
        )
    if flat := sum(v == 0 for v in variances):
        raise _NotHere(
            f"zen reads the variance of what reaches each batch norm, and {flat} of them saw "
            "none across the batch (log 0): give more samples"
        )
    return math.log(total) + sum(0.5 * math.log(v) for v in variances)


def _input_grads(s: _Subject, example: Any, xs: list[torch.Tensor]) -> list[Any]:
    """The gradient of the summed output at each of `xs`, the example's floating tensors;
    None at one it is not computed from (a backward from it does not reach it), however
    little it moves with it: a net of dead units is, a float attention mask is not."""
    leaf = {id(t): t.detach().clone().requires_grad_(True) for t in xs}
    y = sum(t.sum() for t in s.run(_map(example, lambda t: leaf.get(id(t), t))))
    if not (isinstance(y, torch.Tensor) and y.requires_grad):
        return [None] * len(xs)
    return list(torch.autograd.grad(y, list(leaf.values()), allow_unused=True))


def _naswot(s: _Subject, example: Any, **_: Any) -> float:
    codes: list[torch.Tensor] = []
    rows = next((len(t) for t in tensors_in(example) if t.dim()), None)  # the samples

    def code(m: nn.Module, i: tuple, o: Any) -> None:
        for t in tensors_in(o)[:1]:
            if len(t) != rows:
                raise _NotHere(_ROWS % (rows, s.name(m), len(t)))
            codes.append((t.detach().reshape(len(t), -1) > 0).double())

    with s.hooked("naswot", ("activation",), code), torch.no_grad():
        s.run(example)
    if not codes:
        raise _NotHere(_NO_ACTIVATION % ("naswot", "none of them ran on the example"))
    c = torch.cat(codes, dim=1)
    k = c @ c.T + (1 - c) @ (1 - c).T
    return float(torch.linalg.slogdet(k).logabsdet)


_ROWS = (
    "naswot compares the samples' activation codes, row by row: the example has %s rows and %s "
    "saw %d (tokens routed to experts, rows dropped, or tokens as rows), so the samples' codes "
    "cannot be lined up and naswot cannot be taken on this graph"
)


def _jacob_cov(s: _Subject, example: Any, **_: Any) -> float:
    xs = _floats(example, "jacob_cov")
    if xs[0].dim() < 1 or xs[0].shape[0] < 2:
        raise _NotHere("jacob_cov compares samples, and this example has fewer than two")
    j = _input_grads(s, example, xs)[0]
    if j is None:  # zero (dead units) is a score, the worst one; no path is none
        raise _NotHere(
            f"jacob_cov reads the gradient at the example's first floating tensor "
            f"({_named_floats(example)}), and the output is not computed from it (a float mask "
            "is read as a mask): jacob_cov cannot be taken on this example"
        )
    j = j.reshape(j.shape[0], -1).double()
    v = torch.linalg.eigvalsh(torch.nan_to_num(torch.corrcoef(j), nan=0.0))
    k = 1e-5
    return float(-(torch.log(v + k) + 1.0 / (v + k)).sum())


def _snip(s: _Subject, example: Any, *, target: Any, objective: Callable, **_: Any) -> float:
    grads = _grads(_loss(s, example, target, objective), s.params)
    return _log(
        float(sum((p.detach() * g).abs().sum() for p, g in zip(s.params, grads, strict=True)))
    )


def _grasp(s: _Subject, example: Any, *, target: Any, objective: Callable, **_: Any) -> float:
    with sdpa_kernel([SDPBackend.MATH]):  # the one attention kernel whose backward has one
        grads = _grads(_loss(s, example, target, objective), s.params, create_graph=True)
        z = sum((g * g.detach()).sum() for g in grads)
        hg = _grads(z, s.params)
    return float(-sum((p.detach() * h).sum() for p, h in zip(s.params, hg, strict=True)))


def _grad_norm(s: _Subject, example: Any, *, target: Any, objective: Callable, **_: Any) -> float:
    grads = _grads(_loss(s, example, target, objective), s.params)
    return _log(math.sqrt(float(sum((g.double() ** 2).sum() for g in grads))))


def _fisher(s: _Subject, example: Any, *, target: Any, objective: Callable, **_: Any) -> float:
    acts: list[tuple[torch.Tensor, bool]] = []

    def keep(m: nn.Module, i: tuple, o: Any) -> None:
        for t in tensors_in(o)[:1]:
            if t.requires_grad:
                acts.append((t, kind_of(m) == "conv"))

    with s.hooked("fisher", ("conv", "learned"), keep):
        loss = _loss(s, example, target, objective)
    grads = torch.autograd.grad(loss, [a for a, _ in acts], allow_unused=True)
    total = 0.0
    for (a, conv), g in zip(acts, grads, strict=True):
        if g is None:
            continue
        d = (a * g).double()
        if d.dim() > 2:  # summed over positions: after a conv's channels, before features
            d = d.sum(dim=list(range(2, d.dim()) if conv else range(1, d.dim() - 1)))
        total += float(0.5 * d.detach().pow(2).mean(0).sum())
    return _log(total)


_PROXIES: dict[str, Callable[..., float]] = {
    "synflow": _synflow,
    "zen": _zen,
    "naswot": _naswot,
    "jacob_cov": _jacob_cov,
    "snip": _snip,
    "grasp": _grasp,
    "grad_norm": _grad_norm,
    "fisher": _fisher,
}
EVERY: tuple[str, ...] = tuple(_PROXIES)
"""Every proxy `proxy` knows, in the order `proxies` answers them."""


def _take(s: _Subject, example: Any, of: str, target: Any, objective: Any) -> float:
    with untouched(s.held), looking():
        s.quiet()
        # autograd cannot save a tensor made under inference_mode (a data pipeline's): copied
        example, target = mapped((example, target), lambda t: t.clone() if t.is_inference() else t)
        gen = torch.Generator().manual_seed(0)
        score = _PROXIES[of](s, example, gen=gen, target=target, objective=objective)
    if math.isnan(score):  # a score no candidate can be ranked by: said, not given
        raise _NotHere(f"{of} came out nan: the net gives a nan on this example (probe: where)")
    return score


def proxy(graph: Any, example: Any, of: str, *, target: Any = None, objective: Any = None) -> float:
    """One cheap score for one candidate, higher being better. `of` names which: see EVERY.

    snip, grasp, grad_norm and fisher read a loss and want `target` and `objective`
    (`objective(output, target)` giving a scalar). The units are nobody's, and comparing two
    candidates on the same proxy is the only thing it is for, which is why every one that
    spans decades comes back as a logarithm. Deterministic, and the net is left exactly as it
    was. Refuses (ValueError) an unknown name, a loss proxy without a loss, and a proxy this
    graph cannot give (naswot with no activation layer, jacob_cov on a single sample, zen
    where the output does not move with the floating input, as with a float attention mask,
    any that comes out nan, as where the net gives a nan).
    """
    if of not in _PROXIES:
        raise ValueError(f"unknown proxy {of!r}; the proxies are {list(EVERY)}")
    if of in _LOSS and (target is None or objective is None):
        raise ValueError(f"{of} reads a loss: pass target= and objective=(output, target) -> loss")
    try:
        return _take(_Subject(graph), unwrap(example), of, unwrap(target), objective)
    except Exception as e:
        note(e, f"while taking the proxy {of!r}")
        raise


def proxies(
    graph: Any, example: Any, *, target: Any = None, objective: Any = None
) -> dict[str, float]:
    """Every proxy that can be taken with what it was given, as {name: score}.

    Without a target and an objective the four that read a loss are not in the answer, rather
    than being in it as None: a score that is missing and a score that is bad have to look
    different. A proxy this graph cannot give is missing too, with a `ProxyLeftOut` warning
    that names it and says why; the others are still taken. `graph` may be a bare module, and an `Opaque`
    example or target is unwrapped first.
    """
    s = _Subject(graph)
    example, target = unwrap(example), unwrap(target)
    loss = target is not None and objective is not None
    out: dict[str, float] = {}
    for of in EVERY:
        if of in _LOSS and not loss:
            continue
        try:
            out[of] = _take(s, example, of, target, objective)
        except Exception as e:  # noqa: BLE001  (each proxy fails its own way; it is said)
            warn(ProxyLeftOut(of, _why(e)))
    return out
