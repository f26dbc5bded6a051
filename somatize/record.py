"""The record of a run: what a graph did, forward by forward, kept in a store.

A `Recorder` is a watcher: pass it as `watching=` to `Graph.forward` or to a Trainer and it
writes one record per forward under the name `run/<run>/<i>`. The record is the list of facts
of that forward (see docs/internals.md, "Facts"), values with their own types, and its meta
says the run, the forward, its state, how many nodes ran and how long it took::

    rec = Recorder(store)
    trainer = Trainer(g, objective=loss, optimizer=opt, watching=rec)
    trainer.fit(data)
    somatize.record.losses(store, rec.run)      # a DataFrame: step, loss

The readers here (`runs`, `facts`, `timings`, `losses`) need nothing but the store, so a run
can be looked at from another process, or a week later.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from somatize.store import Store, store_of

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Recorder", "facts", "losses", "records", "runs", "timings"]

_BASE = ("run", "forward", "state", "nodes", "took_us")


def _fresh_run() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _check_run(run: str) -> str:
    if not isinstance(run, str) or not run or "/" in run or run in (".", ".."):
        raise ValueError(f"a run is a non-empty name without '/', not {run!r}")
    return run


class Recorder:
    """Writes what a graph does into a store, one record per forward, as `run/<run>/<i>`.

    `run` names the run (default: a fresh time-based id, readable as `.run`). `summarising`,
    if given, is called with the facts of each forward and returns a dict of extra meta
    (refused if it would overwrite run, forward, state, nodes or took_us). A record is
    written when its forward's "finished" fact arrives; facts that come after it (the
    Trainer's loss, updated, health) join the same forward and are written at the next
    forward's first fact, at `flush()`, or at `close()`.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        *,
        run: str | None = None,
        summarising: Callable[[list[dict[str, Any]]], Mapping[str, Any]] | None = None,
    ) -> None:
        if summarising is not None and not callable(summarising):
            raise TypeError(f"summarising is a callable, not {type(summarising).__name__}")
        self.store = store_of(store)
        self.run = _check_run(run) if run is not None else _fresh_run()
        self.summarising = summarising
        self._lock = threading.Lock()
        self._forward = 0
        self._facts: list[dict[str, Any]] = []
        self._finished = False
        self._dirty = False

    def __repr__(self) -> str:
        return f"Recorder({self.store!r}, run={self.run!r}, forwards={self.forwards})"

    @property
    def forwards(self) -> int:
        """How many forwards this recorder has seen begin (the next one is numbered this)."""
        with self._lock:
            return self._forward + (1 if self._facts else 0)

    def __call__(self, fact: Mapping[str, Any]) -> None:
        """Take one fact (a dict with at least a "fact" key). Refuses anything else."""
        if not isinstance(fact, Mapping) or "fact" not in fact:
            raise TypeError(f"a fact is a dict with a 'fact' key, not {fact!r}")
        kind = fact["fact"]
        copied = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in fact.items()}
        with self._lock:
            if kind in ("ran", "finished") and self._finished:
                self._write()
                self._forward += 1
                self._facts = []
                self._finished = False
            self._facts.append(copied)
            self._dirty = True
            if kind == "finished":
                self._finished = True
                self._write()

    def flush(self) -> None:
        """Write the current forward's record if facts arrived since it was last written.
        A forward that has not finished yet is written with state "unfinished"."""
        with self._lock:
            self._write()

    def close(self) -> None:
        """Flush; the recorder may still be used afterwards (it carries on numbering)."""
        self.flush()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self) -> None:
        if not self._dirty or not self._facts:
            return
        finished = [f for f in self._facts if f.get("fact") == "finished"]
        meta: list[tuple[str, Any]] = [
            ("run", self.run),
            ("forward", self._forward),
            ("state", "ok" if finished else "unfinished"),
            ("nodes", sum(1 for f in self._facts if f.get("fact") == "ran")),
            ("took_us", finished[-1].get("took_us") if finished else None),
        ]
        if self.summarising is not None:
            extra = self.summarising(list(self._facts))
            if not isinstance(extra, Mapping):
                raise TypeError(f"summarising returned {type(extra).__name__}, not a dict")
            clash = sorted(set(extra) & set(_BASE))
            if clash:
                raise ValueError(f"summarising may not overwrite the record's own meta {clash}")
            meta.extend(extra.items())
        self.store.keep(f"run/{self.run}/{self._forward}", self._facts, meta=meta)
        self._dirty = False


# -- reading a run back -----------------------------------------------------------------


def _indexed(store: Store, run: str) -> list[tuple[int, str]]:
    found = []
    for name in store.names(f"run/{run}"):
        parts = name.split("/")
        if len(parts) == 3 and parts[2].isdigit():
            found.append((int(parts[2]), name))
    return sorted(found)


def runs(store: Store | str | os.PathLike[str]) -> list[str]:
    """The runs recorded in `store`, oldest first (by when their first record was written)."""
    store = store_of(store)
    first: dict[str, tuple[int, str]] = {}
    for name in store.names("run"):
        parts = name.split("/")
        if len(parts) == 3 and parts[2].isdigit():
            index = int(parts[2])
            if parts[1] not in first or index < first[parts[1]][0]:
                first[parts[1]] = (index, name)
    when = {}
    for run, (_, name) in first.items():
        bound = store.resolve(name)
        when[run] = bound.when if bound is not None else 0.0
    return sorted(first, key=lambda r: (when[r], r))


def records(
    store: Store | str | os.PathLike[str], run: str
) -> list[tuple[int, list[dict[str, Any]]]]:
    """`(forward, facts)` for every recorded forward of `run`, in order. Refuses (with
    `LookupError`) a run the store has not got."""
    store = store_of(store)
    indexed = _indexed(store, _check_run(run))
    if not indexed:
        raise LookupError(f"no run {run!r} in {store!r}; runs there: {runs(store)}")
    return [(index, store.recall(name) or []) for index, name in indexed]


def _typed(values: list[Any]) -> Any:
    """A pandas Series for one column, keeping Python types: bools as bools, ints as ints."""
    import pandas as pd

    values = [v.item() if type(v).__module__ == "numpy" else v for v in values]
    present = [v for v in values if v is not None]
    missing = len(present) < len(values)
    if present and all(type(v) is bool for v in present):
        return pd.Series(values, dtype="boolean" if missing else bool)
    if present and all(type(v) is int and -(2**63) <= v < 2**63 for v in present):
        return pd.Series(values, dtype="Int64" if missing else "int64")
    if present and all(type(v) in (int, float) for v in present):
        return pd.Series([float("nan") if v is None else float(v) for v in values])
    return pd.Series(values, dtype=object)


def _frame(rows: list[dict[str, Any]], first: tuple[str, ...]) -> pd.DataFrame:
    import pandas as pd

    columns = list(first)
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return pd.DataFrame({c: _typed([row.get(c) for row in rows]) for c in columns})


_FACT_COLUMNS = ("fact", "forward", "node", "began_us", "took_us", "value", "step", "where")


def facts(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """Every fact of `run`, one row each: fact, forward, node, began_us, took_us, value,
    step, where, then one column per health number (named by the metric; `numbers.<m>` if
    that name is taken) and any other key a fact carried. Missing cells are NA."""
    rows = []
    for index, forward in records(store, run):
        for fact in forward:
            row: dict[str, Any] = {}
            for key, value in fact.items():
                if key == "numbers" and isinstance(value, Mapping):
                    continue
                row[key] = value
            row["forward"] = index
            numbers = fact.get("numbers")
            if isinstance(numbers, Mapping):
                for metric, value in numbers.items():
                    taken = metric in _FACT_COLUMNS or metric in fact
                    row[f"numbers.{metric}" if taken else str(metric)] = value
            rows.append(row)
    return _frame(rows, _FACT_COLUMNS)


def timings(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """How long each node took in each forward of `run`: forward, node, began_us, took_us."""
    rows = [
        {
            "forward": index,
            "node": fact.get("node"),
            "began_us": fact.get("began_us"),
            "took_us": fact.get("took_us"),
        }
        for index, forward in records(store, run)
        for fact in forward
        if fact.get("fact") == "ran"
    ]
    return _frame(rows, ("forward", "node", "began_us", "took_us"))


def losses(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """The loss curve of `run`: one row per loss fact, step and loss."""
    rows = [
        {"step": fact.get("step"), "loss": fact.get("value")}
        for _, forward in records(store, run)
        for fact in forward
        if fact.get("fact") == "loss"
    ]
    return _frame(rows, ("step", "loss"))
