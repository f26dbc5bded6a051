"""What a recorded run saw, place by place, and what that says: `seen`, `diagnose`, `Verdicts`.

All of them read health facts alone (what a Recorder kept, or a list a watcher collected), so
a diagnosis made later elsewhere is the one made today, by one rule over time (`Verdicts`).
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from somatize.health.flags import Flag
from somatize.health.metrics import FACT_KEYS
from somatize.health.verdict import Thresholds, number, verdict

__all__ = ["WINDOW", "Verdicts", "diagnose", "numbers_of", "seen", "seen_in", "where_of"]

#: how many of a place's last measured steps a flag on it is judged over
WINDOW = 20

_OLD_NAMES = {"zero": "zero_frac_max", "saturated": "sat_frac_max"}


def where_of(fact: Mapping[str, Any]) -> str:
    """The place a health fact is about: `node`, or `node.inside` for a module inside one (a
    fact in the earlier `{"where", "numbers"}` layout names it in `where`)."""
    where = fact.get("where")
    if where is not None:
        return str(where)
    node, inside = fact.get("node"), fact.get("inside")
    if node is None:
        raise ValueError(f"a health fact names its place in 'node' (and 'inside'): {fact!r}")
    return str(node) if not inside else f"{node}.{inside}"


def numbers_of(fact: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of a health fact: every key but fact, node, inside, step (a fact in the
    earlier layout keeps them under `numbers`, with `zero` and `saturated` for today's
    `zero_frac_max` and `sat_frac_max`)."""
    old = fact.get("numbers")
    if isinstance(old, Mapping):
        return {_OLD_NAMES.get(k, k): v for k, v in old.items()}
    return {k: v for k, v in fact.items() if k not in FACT_KEYS}


def _summary(values: deque) -> Any:
    """One metric over several steps, by `seen`'s rule (a measure with no finite value: the last)."""
    last = values[-1]
    if type(last) is bool:
        return any(values)
    if type(last) is int:
        return last
    finite = [v for v in values if (n := number(v)) is not None and math.isfinite(n)]
    return statistics.median(finite) if finite else last


def _summaries(kept: Mapping[str, deque]) -> dict[str, Any]:
    return {k: _summary(v) for k, v in kept.items()}


class Verdicts:
    """The flags of every place as health facts arrive, by the one rule `diagnose` uses: a
    place's numbers over its last `last` measured steps (all of them when None), summarised,
    then judged by `verdict`. What a live figure marks on a place at a step is `add`'s answer
    for that step's fact, so its last column is what `diagnose` says of the run::

        v = Verdicts()
        for fact in facts:
            flags = v.add(fact)        # this place's flags as of this step
        v.flags()                      # == diagnose over the same facts

    Refuses a window under 1.
    """

    def __init__(self, *, last: int | None = WINDOW, thresholds: Thresholds | None = None):
        whole = isinstance(last, numbers.Integral) and not isinstance(last, bool)
        if last is not None and (not whole or last < 1):
            raise ValueError(f"last is a positive number of steps, not {last!r}")
        self.last = None if last is None else int(last)
        self.thresholds = thresholds
        self._kept: dict[str, dict[str, deque]] = {}
        self._flags: dict[str, list[Flag]] = {}

    def add(self, fact: Mapping[str, Any]) -> list[Flag] | None:
        """Take one fact; the flags its place has as of it, or None for a fact that is not a
        health fact (which changes nothing)."""
        if not isinstance(fact, Mapping) or fact.get("fact") != "health":
            return None
        where = where_of(fact)
        kept = self._kept.setdefault(where, {})
        for k, v in numbers_of(fact).items():
            kept.setdefault(k, deque(maxlen=self.last)).append(v)
        flags = self._flags[where] = verdict(_summaries(kept), self.thresholds)
        return flags

    def feed(self, facts: Iterable[Mapping[str, Any]]) -> Verdicts:
        """`add` each of these facts; itself, for chaining."""
        for fact in facts:
            self.add(fact)
        return self

    def numbers(self) -> dict[str, dict[str, Any]]:
        """Each place's summarised numbers, as {where: {metric: value}}."""
        return {where: _summaries(kept) for where, kept in self._kept.items()}

    def flags(self) -> dict[str, list[Flag]]:
        """The places that hold a flag now, as {where: [flag]}; {} for a healthy run."""
        return {where: flags for where, flags in self._flags.items() if flags}


def seen_in(facts: Iterable[Mapping[str, Any]], *, last: int | None = None) -> dict[str, dict]:
    """`seen` over facts already in hand (a list a watcher collected) instead of a store."""
    return Verdicts(last=last).feed(facts).numbers()


def seen(store: Any, *, run: str, last: int | None = None) -> dict[str, dict]:
    """What the audit of `run` saw, as {where: {metric: number}}.

    `where` is a node or `node.path.to.submodule`. Each metric is summarised over the last
    `last` measured steps of that place (all of them when None): a flag such as `nan` is true
    if it was ever true, a count is its latest value, a measure is the median of its finite
    values. `store` is a Store or a directory; an unknown run is a LookupError naming the runs
    there are.
    """
    return Verdicts(last=last).feed(_facts(store, run)).numbers()  # (`last` checked first)


def _facts(store: Any, run: str) -> list[Any]:
    from somatize.record import records

    return [f for _, record in records(store, run) for f in record]


def diagnose(
    store: Any, *, run: str, thresholds: Thresholds | None = None, last: int | None = WINDOW
) -> dict[str, list[Flag]]:
    """The flags each place of `run` holds at the end of it, as {where: [flag]}: `verdict` of
    its numbers over its last `last` measured steps (`Verdicts`' rule, so a live audit's last
    column says the same). Places with none are left out, so a healthy run diagnoses as {}.
    Reads the record alone."""
    return Verdicts(last=last, thresholds=thresholds).feed(_facts(store, run)).flags()
