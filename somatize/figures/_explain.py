"""One sentence for every number a figure shows, and for every flag.

The metrics' sentences are `somatize.health.METRICS` (the audit's own account of what it
measures). The flags' sentences are `somatize.health.about`, their families
`somatize.health.family`.
"""

from __future__ import annotations

PROXIES = {
    "synflow": "Synaptic flow: how much signal can flow through the weights' magnitudes at all "
    "(log; Tanaka et al. 2020).",
    "zen": "Zen score: how strongly the output responds to a small change of the input, "
    "normalised by the batch norms (Lin et al. 2021).",
    "naswot": "How differently the ReLUs fire for different inputs (log-determinant of their "
    "codes' kernel; Mellor et al. 2021).",
    "jacob_cov": "How independent the input gradients of different samples are (Mellor et al. "
    "2020).",
    "snip": "How much the loss depends on the weights as they are (Σ|θ·∂L/∂θ|, log; Lee et al. "
    "2019).",
    "grasp": "How much pruning would hurt the gradient flow (−θ·H·∂L/∂θ; Wang et al. 2020).",
    "grad_norm": "The size of the loss's gradient over every weight (log).",
    "fisher": "How much the loss depends on each layer's outputs (Fisher information, log; "
    "Theis et al. 2018).",
}


def explanations() -> dict[str, dict[str, str]]:
    """One sentence per metric and per flag, as the figures' tooltips say them, and each
    flag's family: {"metrics": ..., "flags": ..., "families": ...}."""
    from somatize import health

    said = {n: n for n in health.__all__ if isinstance(getattr(health, n), health.Flag)}
    counted = ("DEAD_CHANNELS", "IGNORED_CHANNELS")  # flags with a count: said of one
    said |= {n: f"{n}(1)" for n in counted if n in health.__all__}
    return {
        "metrics": dict(health.METRICS),
        "flags": {n: health.about(flag) for n, flag in said.items()},
        "families": {n: health.family(flag) for n, flag in said.items()},
    }
