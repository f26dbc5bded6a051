"""What each recorded number is, in one sentence: `METRICS`, for a figure's tooltip and legend.

The names are those of a flat health fact (the published ones first) and of a probe's answer,
which uses the same names where the quantity is the same.
"""

from __future__ import annotations

#: the keys of a health fact that are not numbers about its place
FACT_KEYS = frozenset({"fact", "node", "inside", "step", "where", "numbers"})

METRICS: dict[str, str] = {
    # the published names
    "act_abs_mean": "The mean absolute value of what the place produced this step.",
    "zero_frac_max": "The largest share of outputs at zero (|a| ≤ dead_eps) over the last "
    "`window` measured steps; near 1 the units are dead.",
    "sat_frac_max": "The largest share of outputs where a sigmoid or tanh is flat (within 0.01 "
    "of its bounds) over the last `window` measured steps; 0 for a place that cannot saturate.",
    "grad_norm": "‖∂L/∂θ‖, the size of the gradient on the place's weights this step.",
    "param_norm": "‖θ‖, the size of the place's weights as the step found them.",
    "param_norm_slope": "How fast ‖θ‖ changes, per step, over the last `window` measured "
    "steps: steady growth is weights drifting apart, steady decay is weight decay winning.",
    "update_ratio": "‖θ′ − θ‖ / ‖θ‖: how much of the weights one update changed; around 1e-3 "
    "is a common healthy pace.",
    "nan": "Whether a NaN was seen here this step (in the output, the weights or their gradient).",
    "inf": "Whether an infinity was seen here this step (in the output, the weights or their "
    "gradient), or values so large their norm overflows.",
    # ours
    "inherited": "Whether the NaN or infinity seen here came from elsewhere (an input another "
    "place gave it, or the gradient arriving at its output); the place where it arose reads False.",
    "out_grad_norm": "‖∂L/∂output‖, the size of the gradient that reached the place's output; "
    "taken on snapshot steps.",
    "effective_rank": "How many directions the place's output really spans over a batch (the "
    "exponential of the entropy of its normalised singular values); taken on snapshot steps.",
    "rank_room": "The most the effective rank could be here: the smaller of the samples and "
    "the channels it was taken over.",
    "rank_share_start": "effective_rank / rank_room at the first snapshot the audit took of "
    "the place: NARROWING is a place that started above narrow_frac and fell under it.",
    "update_stable_rank": "‖Δ‖²_F / ‖Δ‖²_2 of the update to the place's largest weight: about "
    "how many directions one update moves it in (1 is a single direction); on snapshot steps.",
    "channels": "How many channels the place's output has (dim 1 of an image, the last dim of "
    "a sequence).",
    "dead_channels": "Output channels that never rose above dead_eps over the last `window` "
    "measured steps.",
    "dormant_channels": "Output channels whose mean activity is under dormant_tau of the "
    "place's mean this step.",
    "input_channels": "How many channels the place's input has, where a gradient reaches it.",
    "ignored_channels": "Input channels the place ignores: the gradient reaching them is under "
    "dormant_tau of the mean over its input's channels.",
    "cka": "The largest linear CKA between two of the place's declared channel groups: near 1 "
    "they carry the same thing.",
    # a probe's (at initialisation)
    "signal_gain": "RMS of what the place produced over RMS of what it was given, at "
    "initialisation: far from 1, the signal grows or fades through it.",
    "jacobian_gain": "‖Jᵀu‖ / ‖u‖ for random directions u pulled back through the place, "
    "averaged: how much it scales a gradient passing back, at initialisation.",
    "jacobian_spread": "The coefficient of variation of that gain over samples: high when the "
    "place treats inputs very unevenly.",
}
