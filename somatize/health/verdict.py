"""From numbers to flags: `Thresholds` and `verdict`, the one source of every threshold.

The numbers are a health fact (flat: `grad_norm`, `update_ratio`, ...), a summary of several
(`seen`), or a probe's answer; an absent metric raises no flag, keys that are not numbers are
ignored.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from somatize.health.flags import (
    DEAD,
    DEAD_CHANNELS,
    EXPLODING,
    IGNORED_CHANNELS,
    INF,
    LEAKAGE,
    NAN,
    NARROWING,
    OVERSTEPPING,
    SATURATED,
    STALLED,
    VANISHING,
    Flag,
)
from somatize.health.metrics import FACT_KEYS

__all__ = ["Thresholds", "verdict"]


def as_float(v: Any) -> float:
    """`v` as a float, an int a float cannot hold (10**400) as the infinity of its sign (not
    finite, as a NaN or inf is); TypeError or ValueError for what is no number."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def number(v: Any) -> float | None:
    """`v` as a float (`as_float`) if it is a real number (not a bool), numpy's too; None for
    anything else."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    return as_float(v)


@dataclass(frozen=True)
class Thresholds:
    """Where a number becomes a flag. `Thresholds(grad_high=1e4)` changes one and keeps the
    rest; an unknown name is refused (TypeError naming the known ones), and so is a value that
    is no real number (numpy's are taken; a bool is not).

    grad_low / grad_high bound the gradient norm (VANISHING / EXPLODING); dead_eps is how
    close to zero counts as zero, dead_frac the share of zeros that is DEAD; saturated_frac
    the share of saturated outputs that is SATURATED; update_low / update_high bound the
    update ratio ‖Δθ‖/‖θ‖ (STALLED / OVERSTEPPING); step_low is the step per unit of
    gradient, ‖Δθ‖/‖∇θ‖, under which weights that stall do so because the step is small
    (STALLED) rather than the gradient (VANISHING); dormant_tau is the level, relative to the
    mean over a place's channels, under which a channel is dormant (its activity) or ignored
    (the gradient reaching it), dormant_frac the share of ignored input channels that is
    IGNORED_CHANNELS; dead_channel_frac the share of dead output channels that is
    DEAD_CHANNELS; leakage_cka the CKA between groups that is LEAKAGE; narrow_frac the
    effective rank, as a share of the room it has, under which it is NARROWING (a place that
    was under it at its first snapshot, `rank_share_start`, is narrow by make, not NARROWING).

    The defaults flag no healthy training of `bench/health.py`, and each broken net there on
    its cause. An audit counts zeros, dormant and ignored channels at the default dead_eps
    and dormant_tau.
    """

    grad_low: float = 1e-7
    grad_high: float = 1e3
    dead_eps: float = 1e-7
    dead_frac: float = 0.95
    saturated_frac: float = 0.5
    update_low: float = 1e-6
    update_high: float = 0.25
    step_low: float = 1e-4
    dormant_tau: float = 0.1
    dormant_frac: float = 0.5
    dead_channel_frac: float = 0.25
    leakage_cka: float = 0.95
    narrow_frac: float = 0.05

    def __init__(self, **over: float) -> None:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(over) - known)
        if unknown:
            raise TypeError(f"unknown threshold(s) {unknown}; the thresholds are {sorted(known)}")
        for f in fields(self):
            value = number(given := over.get(f.name, f.default))
            if value is None:
                raise TypeError(f"threshold {f.name} is a number, not {given!r}")
            object.__setattr__(self, f.name, value)


_DEFAULT = Thresholds()


def verdict(numbers: Mapping[str, Any], thresholds: Thresholds | None = None) -> list[Flag]:
    """The flags these numbers raise, in a fixed order (numeric, signal, activation, step,
    capacity); empty for a healthy place. Refuses anything that is not a mapping.

    A flag names a cause, so what it explains at the same place is left out: a NaN or an
    infinity (NAN, INF) makes every other number moot; DEAD and SATURATED explain a gradient
    that vanishes and weights that stall there; VANISHING explains STALLED (weights that stall
    under an ordinary step for their gradient, ‖Δθ‖/‖∇θ‖ ≥ step_low, stall because the
    gradient is small, and read VANISHING; under a small step they read STALLED), EXPLODING
    explains OVERSTEPPING, DEAD explains DEAD_CHANNELS and NARROWING; an effective rank of 0
    (an output that does not vary over the batch, as an embedding of a constant input) is not
    NARROWING, which is an output that has come to vary along too few directions: one that
    did from its first snapshot (`rank_share_start` under narrow_frac: a fresh transformer's
    attention, uniform, gives every token of a sample the same mix) is narrow by make. Two rules read what
    arrived from elsewhere: a NaN or inf marked `inherited` (it came in through the input or
    the gradient) raises nothing here, the place where it arose is flagged; and weights whose
    gradient is exactly zero got none at all, so they are neither VANISHING nor STALLED: what
    cut them off downstream (a DEAD or SATURATED place) is flagged. A place whose weights are
    all zero (param_norm 0: a zero-initialised layer such as LoRA's B) is not DEAD: its zeros
    are the weights', which its gradient moves (an Audit gives one frozen at zero no
    zero_frac_max).

    One step's fact gives that step's flags; `diagnose`, `seen` and `Verdicts` give it a
    place's numbers summarised over its last `WINDOW` measured steps.
    """
    if not isinstance(numbers, Mapping):
        raise TypeError(f"verdict reads a dict of numbers, not {type(numbers).__name__}")
    t = thresholds or _DEFAULT
    if not isinstance(t, Thresholds):
        raise TypeError(f"thresholds is a Thresholds(...), not {thresholds!r}")
    got = {k: n for k, v in numbers.items() if k not in FACT_KEYS and (n := number(v)) is not None}
    nan = numbers.get("nan") is True or any(math.isnan(v) for v in got.values())
    inf = numbers.get("inf") is True or any(math.isinf(v) for v in got.values())
    if nan or inf:
        if numbers.get("inherited") is True:
            return []
        return [f for f, on in ((NAN, nan), (INF, inf)) if on]
    flags: list[Flag] = []
    grad = got.get("grad_norm")
    zero = got.get("zero_frac_max")
    sat = got.get("sat_frac_max")
    ratio = got.get("update_ratio")
    weights = got.get("param_norm")
    # zeros from weights that are all zero (a zero-initialised layer: LoRA's B, a residual
    # branch's last norm set to 0) are what it has not learnt yet, not dead units
    dead = zero is not None and zero >= t.dead_frac and weights != 0.0
    saturated = sat is not None and sat >= t.saturated_frac
    cut_off = grad == 0.0 or dead or saturated  # no gradient gets through to these weights
    stall = ratio is not None and ratio < t.update_low
    # a stall with an ordinary step for the gradient it had is the gradient's doing
    step = ratio * weights / grad if stall and weights and grad else None  # ‖Δθ‖ / ‖∇θ‖
    small = grad is not None and (
        0.0 < grad < t.grad_low or (step is not None and step >= t.step_low)
    )
    if grad is not None and grad > t.grad_high:
        flags.append(EXPLODING)
    elif small and not cut_off:
        flags.append(VANISHING)
    if dead:
        flags.append(DEAD)
    if saturated:
        flags.append(SATURATED)
    if ratio is not None and ratio > t.update_high and EXPLODING not in flags:
        flags.append(OVERSTEPPING)
    elif stall and not cut_off and VANISHING not in flags:
        flags.append(STALLED)
    flags += _capacity(got, t, dead)
    return flags


def _capacity(got: dict[str, float], t: Thresholds, dead: bool) -> list[Flag]:
    flags: list[Flag] = []
    gone, channels = got.get("dead_channels"), got.get("channels")
    if gone and channels and gone / channels >= t.dead_channel_frac and not dead:
        flags.append(DEAD_CHANNELS(int(gone)))
    ignored, inputs = got.get("ignored_channels"), got.get("input_channels")
    if ignored and inputs and ignored / inputs >= t.dormant_frac:
        flags.append(IGNORED_CHANNELS(int(ignored)))
    cka = got.get("cka")
    if cka is not None and cka >= t.leakage_cka:
        flags.append(LEAKAGE)
    rank, room = got.get("effective_rank"), got.get("rank_room")
    start = got.get("rank_share_start")
    wide = start is None or start >= t.narrow_frac  # (narrow from the first look: by make)
    if rank and room and room > 1 and rank < t.narrow_frac * room and wide and not dead:
        flags.append(NARROWING)
    return flags
