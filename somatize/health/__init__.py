"""Verdicts over recorded numbers: is this net healthy, and if not, where and how.

    from somatize.health import diagnose, about
    for where, flags in diagnose(store, run="r1").items():
        print(where, flags, [about(f) for f in flags])

`seen` reads what an Audit recorded (or takes a probe's answer, which has the same shape),
`verdict` turns one place's numbers into flags under `Thresholds`, `diagnose` does both for a
whole run. Flags: NAN, INF (numeric); VANISHING, EXPLODING (signal); DEAD, SATURATED
(activation); STALLED, OVERSTEPPING (step); DEAD_CHANNELS(n), IGNORED_CHANNELS(n), LEAKAGE,
NARROWING (capacity). Nothing here imports torch.
"""

from __future__ import annotations

from somatize.health.flags import (
    DEAD,
    DEAD_CHANNELS,
    EXPLODING,
    FAMILIES,
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
    about,
    family,
)
from somatize.health.seen import diagnose, seen, seen_in
from somatize.health.verdict import Thresholds, verdict

__all__ = [
    "DEAD",
    "DEAD_CHANNELS",
    "EXPLODING",
    "FAMILIES",
    "IGNORED_CHANNELS",
    "INF",
    "LEAKAGE",
    "NAN",
    "NARROWING",
    "OVERSTEPPING",
    "SATURATED",
    "STALLED",
    "VANISHING",
    "Flag",
    "Thresholds",
    "about",
    "diagnose",
    "family",
    "seen",
    "seen_in",
    "verdict",
]
