"""What a recorded run saw, place by place, and what that says: `seen`, `diagnose`.

Both read the record alone (the `health` facts a Recorder kept), so a diagnosis made next
week on another machine is the one made today.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from somatize.health.flags import Flag
from somatize.health.verdict import Thresholds, verdict

__all__ = ["seen", "seen_in", "diagnose"]


def _summary(values: list[Any]) -> Any:
    if all(isinstance(v, bool) for v in values):
        return any(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return values[-1]
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    finite = [v for v in numbers if math.isfinite(v)]
    if finite:
        return statistics.median(finite)
    return numbers[-1] if numbers else values[-1]


def seen_in(facts: Iterable[Mapping[str, Any]], *, last: int | None = None) -> dict[str, dict]:
    """`seen` over facts already in hand (a list a watcher collected) instead of a store."""
    steps: dict[str, list[Mapping[str, Any]]] = {}
    for fact in facts:
        if isinstance(fact, Mapping) and fact.get("fact") == "health":
            steps.setdefault(str(fact["where"]), []).append(fact.get("numbers") or {})
    out: dict[str, dict] = {}
    for where, numbers in steps.items():
        if last is not None:
            numbers = numbers[-last:]
        metrics: dict[str, list[Any]] = {}
        for n in numbers:
            for k, v in n.items():
                metrics.setdefault(k, []).append(v)
        out[where] = {k: _summary(v) for k, v in metrics.items()}
    return out


def seen(store: Any, *, run: str, last: int | None = None) -> dict[str, dict]:
    """What the audit of `run` saw, as {where: {metric: number}}.

    `where` is a node or `node.path.to.submodule`. Each metric is summarised over the last
    `last` measured steps of that place (all of them when None): a flag such as `nan` is true
    if it was ever true, a count is its latest value, a measure is the median of its finite
    values. `store` is a Store or a directory; an unknown run is a LookupError naming the runs
    there are.
    """
    from somatize.record import records

    if last is not None and (not isinstance(last, int) or last < 1):
        raise ValueError(f"last is a positive number of steps, not {last!r}")
    facts = [f for _, record in records(store, run) for f in record]
    return seen_in(facts, last=last)


def diagnose(
    store: Any, *, run: str, thresholds: Thresholds | None = None, last: int | None = None
) -> dict[str, list[Flag]]:
    """The flags each place of `run` earned, as {where: [flag]}; places with none are left out,
    so a healthy run diagnoses as {}. Reads the record alone."""
    found = {}
    for where, numbers in seen(store, run=run, last=last).items():
        flags = verdict(numbers, thresholds)
        if flags:
            found[where] = flags
    return found
