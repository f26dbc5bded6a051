"""From numbers to flags: `Thresholds` and `verdict`.

The numbers are what an Audit records per place and step (`grad_norm`, `update_ratio`,
`zero`, ...) or what a probe answers; a metric that is absent raises no flag.
"""

from __future__ import annotations

import math
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

__all__ = ["Thresholds", "verdict"]


@dataclass(frozen=True)
class Thresholds:
    """Where a number becomes a flag. `Thresholds(grad_high=1e4)` changes one and keeps the
    rest; an unknown name is refused (TypeError naming the known ones).

    grad_low / grad_high bound the gradient norm (VANISHING / EXPLODING); dead_eps is how
    close to zero counts as zero, dead_frac the share of zeros that is DEAD; saturated_frac
    the share of saturated outputs that is SATURATED; update_low / update_high bound the
    update ratio ‖Δθ‖/‖θ‖ (STALLED / OVERSTEPPING); dormant_tau is the activity, relative to
    the layer's mean, under which a channel is dormant, dormant_frac the share of dormant
    channels that is IGNORED_CHANNELS; leakage_cka the CKA between groups that is LEAKAGE;
    narrow_frac the effective rank, as a share of the room it has, under which it is NARROWING.
    """

    grad_low: float = 1e-7
    grad_high: float = 1e3
    dead_eps: float = 1e-7
    dead_frac: float = 0.95
    saturated_frac: float = 0.5
    update_low: float = 1e-4
    update_high: float = 1e-2
    dormant_tau: float = 0.1
    dormant_frac: float = 0.5
    leakage_cka: float = 0.95
    narrow_frac: float = 0.05

    def __init__(self, **over: float) -> None:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(over) - known)
        if unknown:
            raise TypeError(f"unknown threshold(s) {unknown}; the thresholds are {sorted(known)}")
        for f in fields(self):
            value = over.get(f.name, f.default)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"threshold {f.name} is a number, not {value!r}")
            object.__setattr__(self, f.name, float(value))


def _num(numbers: Mapping[str, Any], key: str) -> float | None:
    v = numbers.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def verdict(numbers: Mapping[str, Any], thresholds: Thresholds | None = None) -> list[Flag]:
    """The flags these numbers raise, in a fixed order (numeric, signal, activation, step,
    capacity). Empty for a healthy place. Refuses anything that is not a mapping."""
    if not isinstance(numbers, Mapping):
        raise TypeError(f"verdict reads a dict of numbers, not {type(numbers).__name__}")
    t = thresholds or Thresholds()
    flags: list[Flag] = []
    values = [v for v in numbers.values() if isinstance(v, float)]
    if numbers.get("nan") is True or any(math.isnan(v) for v in values):
        flags.append(NAN)
    if numbers.get("inf") is True or any(math.isinf(v) for v in values):
        flags.append(INF)
    grad = _num(numbers, "grad_norm")
    if grad is not None and math.isfinite(grad):
        if grad < t.grad_low:
            flags.append(VANISHING)
        elif grad > t.grad_high:
            flags.append(EXPLODING)
    zero = _num(numbers, "zero")
    if zero is not None and zero >= t.dead_frac:
        flags.append(DEAD)
    sat = _num(numbers, "saturated")
    if sat is not None and sat >= t.saturated_frac:
        flags.append(SATURATED)
    ratio = _num(numbers, "update_ratio")
    if ratio is not None and math.isfinite(ratio):
        if ratio < t.update_low:
            flags.append(STALLED)
        elif ratio > t.update_high:
            flags.append(OVERSTEPPING)
    dead = _num(numbers, "dead_channels")
    if dead and DEAD not in flags:
        flags.append(DEAD_CHANNELS(int(dead)))
    dormant = _num(numbers, "dormant_channels")
    channels = _num(numbers, "channels")
    if dormant and channels and dormant / channels >= t.dormant_frac:
        flags.append(IGNORED_CHANNELS(int(dormant)))
    cka = _num(numbers, "cka")
    if cka is not None and cka >= t.leakage_cka:
        flags.append(LEAKAGE)
    rank, room = _num(numbers, "effective_rank"), _num(numbers, "rank_room")
    if rank is not None and room and room > 1 and rank < t.narrow_frac * room:
        flags.append(NARROWING)
    return flags
