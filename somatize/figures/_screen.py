"""Which rows of numbers the health verdict needs to read, found for many rows at once.

The live audit judges every health fact it sends. `somatize.health.verdict` reads one dict at
a time; most rows of a healthy run raise nothing, so for the default verdict a vectorised
screen over the columns picks the rows that could raise a flag, and only those are handed to
the verdict. The screen is conservative (a row it keeps may still raise nothing) and mirrors
the verdict's rules under default `Thresholds`; `tests/test_figures.py` checks it against the
verdict itself on rows around every threshold, so a rule added there without one here fails.
Any other verdict reads every row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

# "absent" in a column: a NaN with a payload of its own, told apart from a measured NaN by its
# bits (a place whose facts do not all carry the same metrics has holes)
MISSING_BITS = 0x7FF8_534D_5A00_0001
# a bool in a column (the live audit keeps nan/inf flags this way, 8 bytes a value): NaNs with
# payloads of their own next to MISSING_BITS, absent to the screen like a hole
FALSE_BITS = MISSING_BITS + 1
TRUE_BITS = MISSING_BITS + 2

# a value that is not a number (a bool, or something kept aside by the live audit) raises a
# flag under the default verdict only as True under one of these (the verdict reads a bool
# nowhere else): so only those rows need the verdict besides the ones the screen keeps
ALARMS = frozenset({"nan", "inf"})

_MISSING = np.uint64(MISSING_BITS)
_SPECIALS = np.uint64(TRUE_BITS - MISSING_BITS)

Screen = Callable[[Mapping[str, np.ndarray], int], np.ndarray]

# metrics the default verdict reads other than for NaN / infinity
_READ = {
    "grad_norm",
    "zero",
    "saturated",
    "update_ratio",
    "dead_channels",
    "dormant_channels",
    "channels",
    "cka",
    "effective_rank",
    "rank_room",
}


def every_row(columns: Mapping[str, np.ndarray], count: int) -> np.ndarray:
    """All rows: for a verdict the screen knows nothing about."""
    return np.arange(count)


def screen_of(verdict: Callable | None) -> Screen:
    """The screen for `verdict`: a vectorised one for `somatize.health.verdict`, every row for
    anything else."""
    try:
        from somatize.health import Thresholds
        from somatize.health import verdict as default
    except ImportError:
        return every_row
    if verdict is not default:
        return every_row
    t = Thresholds()

    def screen(columns: Mapping[str, np.ndarray], count: int) -> np.ndarray:
        """Rows whose numbers could raise a flag under default thresholds. `columns` hold
        `MISSING_BITS` where a metric is absent."""
        hit = np.zeros(count, dtype=bool)
        with np.errstate(invalid="ignore", divide="ignore"):
            for name, a in columns.items():
                # a NaN that is not 'absent' is NAN; an infinity is INF
                odd = ~np.isfinite(a)
                if odd.any():
                    # neither a hole nor a bool (MISSING_BITS .. TRUE_BITS; the subtraction
                    # wraps for anything below, so that is "present" too)
                    present = a.view(np.uint64) - _MISSING > _SPECIALS
                    hit |= odd & present
                    a = np.where(present, a, np.nan)  # canonical NaN: false in every test
                if name not in _READ:
                    continue
                if name == "grad_norm":
                    hit |= (a < t.grad_low) | (a > t.grad_high)
                elif name == "zero":
                    hit |= a >= t.dead_frac
                elif name == "saturated":
                    hit |= a >= t.saturated_frac
                elif name == "update_ratio":
                    hit |= (a < t.update_low) | (a > t.update_high)
                elif name in ("dead_channels", "dormant_channels"):
                    hit |= (a != 0) & ~np.isnan(a)
                elif name == "cka":
                    hit |= a >= t.leakage_cka
            rank, room = columns.get("effective_rank"), columns.get("rank_room")
            if rank is not None and room is not None:
                hit |= (room > 1) & (rank < t.narrow_frac * room)
        return np.flatnonzero(hit)

    return screen
