"""One sentence for every number a figure shows, and for every flag.

The metrics' sentences come from `somatize.health.METRICS` where it has one for a name (the
audit's own account of what it measures); the ones here stand in for names it does not
cover. The flags' sentences are `somatize.health.about`, their families
`somatize.health.family`.
"""

from __future__ import annotations

_OWN_METRICS = {
    "update_ratio": "How much a step moved the weights, as a share of their size (‖Δθ‖/‖θ‖): "
    "around 1e-3 is learning, far below is stalled, far above oversteps.",
    "grad_norm": "The size of the gradient on the weights here (‖∂L/∂θ‖): tiny is vanishing, "
    "huge is exploding.",
    "param_norm": "The size of the weights here (‖θ‖).",
    "param_norm_slope": "How fast the size of the weights changes from step to step.",
    "act_abs_mean": "The mean size of what this place outputs (mean |a|).",
    "act_mean": "The mean of what this place outputs.",
    "zero_frac_max": "The largest share of outputs that are exactly zero, over the window: near "
    "1 means dead units.",
    "zero": "The largest share of outputs that are exactly zero, over the window: near 1 means "
    "dead units.",
    "sat_frac_max": "The largest share of outputs where the activation is flat (saturated), "
    "over the window: no gradient passes there.",
    "saturated": "The largest share of outputs where the activation is flat (saturated), over "
    "the window: no gradient passes there.",
    "nan": "Whether a value here was NaN.",
    "inf": "Whether a value here was infinite.",
    "effective_rank": "How many directions the outputs really use (the effective rank of "
    "their covariance).",
    "rank_room": "The most directions the outputs could use: the smaller of the batch size and "
    "the output width, the ceiling for effective_rank.",
    "out_grad_norm": "The size of the gradient reaching this place's output (‖∂L/∂a‖).",
    "update_stable_rank": "How many directions one update of the largest weight here really "
    "moves (its stable rank ‖Δθ‖²_F / ‖Δθ‖²_2): near 1 is a rank-one step.",
    "channels": "How many output channels this place has.",
    "dead_channels": "Channels that were never active over the window.",
    "dormant_channels": "Channels far less active than the layer's average this step.",
    "cka": "How alike two declared channel groups are (linear CKA): near 1, they carry the "
    "same information.",
    "gain": "How much this place scales the signal through it at initialisation (output size "
    "over input size): far from 1 the signal grows or dies with depth.",
    "signal_gain": "How much this place scales the signal through it at initialisation (output "
    "size over input size): far from 1 the signal grows or dies with depth.",
    "jacobian_gain": "How much this place stretches a small change of its input (the size of "
    "its Jacobian along random directions): far from 1 gradients grow or vanish.",
    "jacobian_spread": "How unevenly it stretches different directions (the spread of those "
    "gains): high means some directions are lost.",
}

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

    metrics = {**_OWN_METRICS, **(getattr(health, "METRICS", None) or {})}
    names = [n for n in health.__all__ if isinstance(getattr(health, n), health.Flag)]
    names += [n for n in ("DEAD_CHANNELS", "IGNORED_CHANNELS") if n in health.__all__]
    flags, families = {}, {}
    for name in names:
        flag = f"{name}(1)" if name in ("DEAD_CHANNELS", "IGNORED_CHANNELS") else name
        flags[name] = health.about(flag)
        families[name] = health.family(flag)
    return {"metrics": metrics, "flags": flags, "families": families}
