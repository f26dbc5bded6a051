"""What a live audit has seen, as plain columns: per run, the loss; per watched place, its
steps, a column per metric (None where a fact did not carry it) and each step's flags, judged
behind the columns by the rule `diagnose` uses (`somatize.health.Verdicts`)."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from somatize.figures._page import jsonable
from somatize.health import Verdicts, where_of
from somatize.health import numbers_of as health_numbers
from somatize.health.metrics import FACT_KEYS
from somatize.health.verdict import as_float, number

_PLAIN = (float, int, bool)
STEPS = range(-(1 << 63), 1 << 63)  # a step is an int that fits in 64 bits
_NONE: list[str] = []


def step_of(fact: Mapping[str, Any]) -> int:
    """A fact's step, checked: an integer that fits in 64 bits."""
    step = fact.get("step")
    if type(step) is not int:
        try:
            whole = not isinstance(step, bool) and float(step) == int(step)  # numpy ints
        except (TypeError, ValueError, OverflowError):
            whole = False
        if not whole:
            raise ValueError(f"a fact's 'step' is an integer, not {step!r} (in {fact!r:.200})")
        step = int(step)
    if step not in STEPS:
        raise ValueError(f"a fact's 'step' must fit in 64 bits, not {step!r}; count steps from 0")
    return step


def numbers_of(fact: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers a health fact carries: every key but the fact's own (`fact`, `node`,
    `inside`, `step`) holding a number or a bool (a numpy or torch scalar made a number)."""
    out = {}
    for k, v in health_numbers(fact).items():
        if type(v) not in _PLAIN and callable(getattr(v, "item", None)):
            try:
                v = v.item()
            except (TypeError, ValueError, RuntimeError):
                continue
        if type(v) in _PLAIN:
            out[str(k)] = v
    return out


@dataclass(slots=True)
class Place:
    """One watched place in one run; `judged` rows have their flags."""

    steps: list[int] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    flags: list[list[str]] = field(default_factory=list)
    judged: int = 0

    def add(self, step: int, numbers: dict[str, Any]) -> None:
        rows = len(self.steps)
        columns = self.columns
        for name, value in numbers.items():
            column = columns.get(name)
            if column is None:
                column = columns[name] = [None] * rows
            column.append(value)
        if len(numbers) != len(columns):
            for column in columns.values():
                if len(column) == rows:
                    column.append(None)
        self.steps.append(step)
        self.flags.append(_NONE)


@dataclass(slots=True)
class Run:
    """One run: its loss, and its places in the order first seen."""

    loss_steps: list[int] = field(default_factory=list)
    loss_values: list[float] = field(default_factory=list)
    places: dict[str, Place] = field(default_factory=dict)


class History:
    """Everything a live audit has seen, by run; `flags`: whether the health verdict judges
    each step (else no step has a flag)."""

    def __init__(self, flags: bool = True) -> None:
        self.judges: dict[str, Any] = {}  # a run's Verdicts, fed its facts in order
        self.rule = Verdicts if flags else None
        self.runs: dict[str, Run] = {}
        self.metrics: dict[str, None] = {}  # in the order first seen
        self.version = 0  # one more for every change

    def run(self, name: str) -> Run:
        return self.runs.setdefault(name, Run())

    def health(self, run: str, fact: Mapping[str, Any]) -> None:
        """Keep one health fact (checked when it was taken) as a row of its place."""
        node, step = fact.get("node"), fact.get("step")
        if type(node) is str and type(step) is int:  # a flat fact, as an Audit tells it
            inside = fact.get("inside")
            where = f"{node}.{inside}" if inside else node
            numbers = {k: v for k, v in fact.items() if type(v) in _PLAIN and k not in FACT_KEYS}
            if len(fact) - len(numbers) > 3 + ("inside" in fact):  # a numpy scalar, perhaps
                numbers = numbers_of(fact)
        else:
            where, numbers, step = where_of(fact), numbers_of(fact), step_of(fact)
        places = self.run(run).places
        place = places.get(where)
        if place is None:
            place = places[where] = Place()
        place.add(step, numbers)
        self.metrics.update(dict.fromkeys(numbers))
        self.version += 1

    def loss(self, run: str, fact: Mapping[str, Any]) -> None:
        value = number(fact.get("value"))  # past a float's range: ±inf; no number: NaN
        step, r = fact.get("step"), self.run(run)
        r.loss_steps.append(len(r.loss_steps) if step is None else int(step))
        r.loss_values.append(math.nan if value is None else value)
        self.version += 1

    def judge(self, until: float | None = None) -> bool:
        """Judge the rows not judged yet, each place's in order, until `until` (a
        `time.perf_counter()` reading; None: all of them); whether any was."""
        judged = False
        for name, run in self.runs.items():
            if self.rule is None:
                for place in run.places.values():
                    place.judged = len(place.steps)
                continue
            judge = self.judges.setdefault(name, self.rule())
            for where, place in run.places.items():
                while place.judged < len(place.steps):
                    r = place.judged
                    numbers = {k: c[r] for k, c in place.columns.items() if c[r] is not None}
                    fact = {"fact": "health", "node": where, "step": place.steps[r], **numbers}
                    place.flags[r] = [str(f) for f in judge.add(fact)]
                    place.judged = r + 1
                    judged = True
                    if until is not None and (r & 15) == 15 and time.perf_counter() > until:
                        self.version += 1
                        return True
        if judged:
            self.version += 1
        return judged

    def places(self) -> list[str]:
        """Every place of every run, in the order first seen."""
        return list(dict.fromkeys(w for r in self.runs.values() for w in r.places))

    def kinds(self) -> dict[str, str]:
        """What each metric holds: bool, int or float (its first value says)."""
        out: dict[str, str] = {}
        for run in self.runs.values():
            for place in run.places.values():
                for name, column in place.columns.items():
                    if name not in out:  # (a column holds only float, int, bool and None)
                        out[name] = type(next((v for v in column if v is not None), 0.0)).__name__
        return out


def _numbers(values: list[Any], buffers: list | None) -> Any:
    """Values as float64 (a bool as 0 or 1, None as NaN, told apart by `absent`): a
    little-endian buffer appended to `buffers` (`{"buffer": its index}`), or with no buffers
    as JSON holds them (NaN and infinities as "nan", "inf", "-inf", None as null)."""
    if buffers is None:
        return jsonable([None if v is None else as_float(v) for v in values])
    part = [math.nan if v is None else as_float(v) for v in values]
    buffers.append(struct.pack(f"<{len(part)}d", *part))
    return {"buffer": len(buffers) - 1}


def _column(values: list[Any], buffers: list | None) -> dict[str, Any]:
    numbers = _numbers(values, buffers)
    c = numbers if buffers is not None else {"values": numbers}
    if None in values:
        c["absent"] = [i for i, v in enumerate(values) if v is None]
    return c


def message(history: History, sent: dict, buffers: list | None, everything: bool = False) -> dict:
    """What is new since `sent` (a dict of counts this updates; with `everything`, all there
    is), as the page reads it: per run, the loss, and per place its new steps (`from` its row
    where they start), every metric's values (binary buffers appended to `buffers`; None: as
    JSON), which rows did not have a metric (`absent`), and the flags of the rows judged
    since."""
    runs = []
    for name, run in history.runs.items():
        lo = 0 if everything else sent.get((name, None), 0)
        hi = len(run.loss_steps)
        sent[(name, None)] = hi
        entry: dict[str, Any] = {"run": name, "places": []}
        if hi > lo:
            values = run.loss_values[lo:hi]
            entry["loss"] = {"steps": run.loss_steps[lo:hi], "values": _numbers(values, buffers)}
        for where, place in run.places.items():
            lo = 0 if everything else sent.get((name, where), 0)
            hi = len(place.steps)
            sent[(name, where)] = hi
            if hi > lo:
                columns = {
                    m: _column(c[lo:hi], buffers)
                    for m, c in place.columns.items()
                    if any(v is not None for v in c[lo:hi])
                }
                part = {"where": where, "from": lo, "steps": place.steps[lo:hi], "columns": columns}
                entry["places"].append(part)
            lo = 0 if everything else sent.get((name, where, "judged"), 0)
            sent[(name, where, "judged")] = place.judged
            rows = [[r, place.flags[r]] for r in range(lo, place.judged) if place.flags[r]]
            if rows:
                entry.setdefault("flags", []).append({"where": where, "rows": rows})
        if "loss" in entry or entry["places"] or "flags" in entry:
            runs.append(entry)
    return {"runs": runs, "metrics": list(history.metrics), "kinds": history.kinds()}


def record(history: History, most: int = 240) -> dict:
    """Everything seen, as a `reset` message in JSON, each place thinned to at most about
    `most` rows (a kept row stands for its bin: the bin's last row and value, every flag in
    the bin; `of` its rows in all) and each loss to 2000 points: what a page with no kernel
    draws from."""
    thin = History(flags=False)
    thin.metrics = history.metrics
    for name, run in history.runs.items():
        every = max(1, -(-len(run.loss_steps) // 2000))
        into = thin.run(name)
        into.loss_steps, into.loss_values = run.loss_steps[::every], run.loss_values[::every]
        for where, place in run.places.items():
            rows = len(place.steps)
            per = max(1, -(-rows // most))
            bins = [range(k, min(rows, k + per)) for k in range(0, rows, per)]
            into.places[where] = Place(
                steps=[place.steps[b[-1]] for b in bins],
                columns={
                    m: [next((c[r] for r in reversed(b) if c[r] is not None), None) for b in bins]
                    for m, c in place.columns.items()
                },
                flags=[sorted({f for r in b for f in place.flags[r]}) for b in bins],
                judged=len(bins),
            )
    body = message(thin, {}, None, everything=True)
    for entry in body["runs"]:
        for part in entry["places"]:
            part["of"] = len(history.runs[entry["run"]].places[part["where"]].steps)
    return {"kind": "reset", **body}
