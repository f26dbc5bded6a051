"""Verdicts over recorded numbers: is this net healthy, and if not, where and how.

    from somatize.health import diagnose, about
    for where, flags in diagnose(store, run="r1").items():
        print(where, flags, [about(f) for f in flags])

`seen` reads what an Audit recorded (or takes a probe's answer, which has the same shape),
`verdict` turns one place's numbers into flags under `Thresholds` (the one source of every
threshold), `diagnose` does both for a whole run, and `Verdicts` does it fact by fact as they
arrive (what a live figure marks). `METRICS` says what each number is, `where_of` which place
a fact is about. Flags: NAN, INF (numeric); VANISHING, EXPLODING (signal); DEAD, SATURATED
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
from somatize.health.metrics import METRICS
from somatize.health.seen import WINDOW, Verdicts, diagnose, numbers_of, seen, seen_in, where_of
from somatize.health.verdict import Thresholds, verdict

__all__ = [
    "DEAD",
    "DEAD_CHANNELS",
    "EXPLODING",
    "FAMILIES",
    "IGNORED_CHANNELS",
    "INF",
    "LEAKAGE",
    "METRICS",
    "NAN",
    "NARROWING",
    "OVERSTEPPING",
    "SATURATED",
    "STALLED",
    "VANISHING",
    "WINDOW",
    "Flag",
    "Thresholds",
    "Verdicts",
    "about",
    "diagnose",
    "family",
    "numbers_of",
    "seen",
    "seen_in",
    "verdict",
    "where_of",
]
