"""The record of a run: what a graph did, forward by forward, kept in a store.

A `Recorder` is a watcher (`watching=` of `Graph.forward` or of a Trainer) that writes one
record per forward, the list of its facts (docs/internals.md, "Facts"), as `run/<run>/<i>`::

    rec = Recorder(store, run="tuesday", summarising=["loss"])
    trainer = Trainer(g, objective=loss, optimizer=opt, watching=rec)
    trainer.fit(data)
    somatize.record.runs(store)                 # a DataFrame: a row per run
    somatize.record.curve(store, "tuesday")     # a DataFrame: forward, step, value

The readers here (`runs`, `forwards`, `nodes`, `curve`, `facts`, `timings`, `losses`) need
nothing but the store, so a run can be looked at from another process, or a week later.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from somatize.codecs import encode
from somatize.health.verdict import number
from somatize.run import warn
from somatize.store import Store, _meta_pairs, store_of

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Recorder",
    "curve",
    "facts",
    "forwards",
    "losses",
    "nodes",
    "records",
    "runs",
    "timings",
]

Summariser = Callable[[list[dict[str, Any]]], Mapping[str, Any]]
"""What `summarising=` may be besides fact names: the facts of a forward in, extra meta out."""


def _is_run(run: Any) -> bool:
    return isinstance(run, str) and "/" not in run and run not in ("", ".", "..")


def _check_run(run: str) -> str:
    if not _is_run(run):
        raise ValueError(f"a run is a non-empty name without '/', not {run!r}")
    return run


def _summariser(summarising: Summariser | Iterable[str] | None) -> Summariser | None:
    """`summarising` as a function of a forward's facts: a callable as it is; fact names as
    the function that answers `<name>.value`, the value of the last such fact (or None)."""
    if summarising is None or callable(summarising):
        return summarising
    try:
        names = [summarising] if isinstance(summarising, str) else list(summarising)
    except TypeError:
        names = []
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"summarising is the names of facts (say ['loss']) or a callable, not {summarising!r}"
        )

    def last_values(facts: list[dict[str, Any]]) -> dict[str, Any]:
        last = {f"{name}.value": None for name in names}
        for fact in facts:
            key = f"{fact.get('fact')}.value"
            if key in last:
                last[key] = fact.get("value")
        return last

    return last_values


class Recorder:
    """Writes what a graph does into a store, one record per forward, as `run/<run>/<i>`.

    `run` names the run (default: a fresh time-based id, readable as `.run`). `summarising`
    names facts to summarise, `["loss"]`: every record's meta then carries `loss.value`, the
    value of the last loss fact of that forward (None if it had none). It may instead be a
    callable, given the facts of each forward, returning a dict of extra meta (refused if it
    would overwrite run, forward, state, nodes, took_us or when); it may read the recorder
    (`forwards`), and may not feed or flush it (a `RuntimeError`). A record is written when its
    forward's "finished" fact arrives; facts that come after it (the Trainer's loss, updated,
    health) join the same forward and are written at the next forward's first fact, at
    `flush()`, or at `close()`. A forward whose node raised never finishes: its record says
    state "broke" once the next forward begins ("unfinished" if nothing came after it).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        *,
        run: str | None = None,
        summarising: Summariser | Iterable[str] | None = None,
    ) -> None:
        self.summarising = _summariser(summarising)
        self.store = store_of(store)
        if run is None:  # a fresh time-based id
            run = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        self.run = _check_run(run)
        self._lock = threading.RLock()  # a summariser, called under it, may read `forwards`
        self._summarising = False  # True while the summariser runs (in the lock's thread)
        self._forward = 0
        self._number: int | None = None  # the record name this forward claimed, once written
        held = [f[1] for name in self.store.names(f"run/{run}") if (f := _forward_of(name))]
        self._next = max(held) + 1 if held else 0  # where to start claiming
        if held:
            warn(
                f"run {self.run!r} already holds {len(held)} record(s) in {self.store!r}: "
                f"this recorder's are numbered after them, in the same run; pass another "
                f"run= (or none, for a fresh one) to keep two runs apart"
            )
        self._facts: list[dict[str, Any]] = []
        self._ran: set[Any] = set()
        self._finished = False
        self._dirty = False

    def __repr__(self) -> str:
        return f"Recorder({self.store!r}, run={self.run!r}, forwards={self.forwards})"

    @property
    def forwards(self) -> int:
        """How many forwards this recorder has seen begin."""
        with self._lock:
            return self._forward + (1 if self._facts else 0)

    def __call__(self, fact: Mapping[str, Any]) -> None:
        """Take one fact (a dict with at least a "fact" key). Refuses anything else."""
        if not isinstance(fact, Mapping) or "fact" not in fact:
            raise TypeError(f"a fact is a dict with a 'fact' key, not {fact!r}")
        kind = fact["fact"]
        copied = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in fact.items()}
        with self._lock:
            self._not_summarising("fed it a fact")
            # a node ran twice: the forward before never finished, it broke
            again = kind == "ran" and not self._finished and fact.get("node") in self._ran
            if (kind in ("ran", "finished") and self._finished) or again:
                self._dirty |= again  # written as unfinished (a flush), it now reads broke
                self._write(broke=again)
                self._forward += 1
                self._number = None
                self._facts, self._ran = [], set()
                self._finished = False
            if kind == "ran":
                self._ran.add(fact.get("node"))
            self._facts.append(copied)
            self._dirty = True
            if kind == "finished":
                self._finished = True
                self._write()

    def flush(self) -> None:
        """Write the current forward's record if facts arrived since it was last written.
        A forward that has not finished yet is written with state "unfinished"."""
        with self._lock:
            self._not_summarising("flushed it")
            self._write()

    def _not_summarising(self, did: str) -> None:
        """Refuse a summariser that writes to the recorder whose record it is summarising."""
        if self._summarising:
            raise RuntimeError(
                f"the summarising= callable of run {self.run!r} {did} while the record it "
                f"summarises was being written; it is given the forward's facts and answers "
                f"a dict of meta: read what it needs from the facts, and feed the recorder "
                f"from outside it"
            )

    def close(self) -> None:
        """Flush; the recorder may still be used afterwards (it carries on numbering)."""
        self.flush()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, broke: bool = False) -> None:
        if not self._dirty or not self._facts:
            return
        meta = self._meta(broke)  # the summariser asked once, and refused before any write
        if self._number is None:  # the first write of this forward: claim a free number,
            data = encode(self._facts, where=f"the record of run {self.run!r}")
            key = self.store.put(data)  # the facts written down, the meta is too: see _meta
            number = self._next  # so that no other recorder of this run writes over it
            while not self.store.claim(f"run/{self.run}/{number}", key, meta):
                number += 1
                meta["forward"] = number
            self._number, self._next = number, number + 1
        else:
            self.store.keep(f"run/{self.run}/{self._number}", self._facts, meta=meta)
        self._dirty = False

    def _meta(self, broke: bool) -> dict[str, Any]:
        """The meta of this forward's record, numbered `_number` (or `_next`, to claim)."""
        finished = [f for f in self._facts if f.get("fact") == "finished"]
        meta: dict[str, Any] = {
            "run": self.run,
            "forward": self._next if self._number is None else self._number,
            "state": "ok" if finished else "broke" if broke else "unfinished",
            "nodes": sum(1 for f in self._facts if f.get("fact") == "ran"),
            "took_us": finished[-1].get("took_us") if finished else None,
        }
        if self.summarising is not None:
            self._summarising = True
            try:
                extra = self.summarising(list(self._facts))
            finally:
                self._summarising = False
            if not isinstance(extra, Mapping):
                raise TypeError(f"summarising returned {type(extra).__name__}, not a dict")
            clash = sorted(set(extra) & {"when", *meta})  # when: forwards() adds it
            if clash:
                raise ValueError(f"summarising may not overwrite the record's own meta {clash}")
            # refused here as claim would refuse it (pairs, str keys, a codec for each value),
            # not after the record's blob is put; the record's own meta is the facts' numbers
            encode(_meta_pairs(extra, f"run/{self.run}"), where=f"the meta of run {self.run!r}")
            meta.update(extra)
        return meta


# -- reading a run back -----------------------------------------------------------------


def _forward_of(name: str) -> tuple[str, int] | None:
    """`(run, forward)` of a record's name, `run/<run>/<forward>`; None for any other name
    (one that a Recorder cannot have written: a run named '..', a forward of '²')."""
    parts = name.split("/")
    if len(parts) != 3 or not _is_run(parts[1]) or not re.fullmatch("[0-9]+", parts[2]):
        return None
    return parts[1], int(parts[2])


def _run_ids(store: Store) -> list[str]:
    """The names of the runs recorded in `store`."""
    return sorted({found[0] for name in store.names("run") if (found := _forward_of(name))})


def _records(store: Store, run: str) -> list[tuple[int, str]]:
    """`(forward, name)` of every record of `run`, in order. Refuses (with `LookupError`) a
    run the store has not got."""
    names = store.names(f"run/{_check_run(run)}")
    found = sorted((f[1], name) for name in names if (f := _forward_of(name)))
    if not found:
        raise LookupError(f"no run {run!r} in {store!r}; runs there: {_run_ids(store)}")
    return found


def _when(seconds: Any) -> Any:
    import pandas as pd

    # a time no clock gives (1e300 s, NaN) reads as NaT, not as an error for the whole table:
    # one past what a timestamp holds is NaT before pandas sees it (pandas 2 raises on it)
    seconds = pd.Series(seconds, dtype="float64")
    seconds = seconds.where(seconds.abs() < pd.Timestamp.max.timestamp())
    return pd.to_datetime(seconds, unit="s", utc=True, errors="coerce")


def runs(store: Store | str | os.PathLike[str]) -> pd.DataFrame:
    """A row per run recorded in `store`, oldest first: run, forwards (how many records),
    broke (how many forwards did not finish), took_us (their time added up), first and last
    (when its first and its latest record were written, as UTC timestamps). Read from the
    records' meta alone. `runs(store)["run"].tolist()` are the run names."""
    store = store_of(store)
    rows = []
    for run in _run_ids(store):
        bound = [store.resolve(name) for _, name in _records(store, run)]
        took = [t for b in bound if (t := number(b.get("took_us"))) is not None]
        rows.append(
            {
                "run": run,
                "forwards": len(bound),
                "broke": sum(1 for b in bound if b.get("state") != "ok"),
                "took_us": float(sum(took)),
                "first": min(b.when for b in bound),
                "last": max(b.when for b in bound),
            }
        )
    rows.sort(key=lambda row: row["first"])  # oldest first; a tie stays in name order
    frame = _frame(rows, ("run", "forwards", "broke", "took_us", "first", "last"))
    frame["took_us"] = frame["took_us"].astype("float64")
    frame["first"], frame["last"] = _when(frame["first"]), _when(frame["last"])
    return frame


def forwards(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """A row per recorded forward of `run`: forward, state ("ok", "broke", "unfinished"),
    nodes, took_us, when (a UTC timestamp), then a column per summarised value (say
    `loss.value`) and any other meta. Read from the records' meta alone; refuses (with
    `LookupError`) a run the store has not got."""
    store = store_of(store)
    bound = [store.resolve(name) for _, name in _records(store, run)]
    rows = [{k: v for k, v in b.meta if k != "run"} for b in bound]
    frame = _frame(rows, ("forward", "state", "nodes", "took_us"))
    frame.insert(4, "when", _when([b.when for b in bound]))
    return frame


def records(
    store: Store | str | os.PathLike[str], run: str
) -> list[tuple[int, list[dict[str, Any]]]]:
    """`(forward, facts)` for every recorded forward of `run`, in order. Refuses (with
    `LookupError`) a run the store has not got."""
    store = store_of(store)
    out = []
    for index, name in _records(store, run):
        facts = store.recall(name) or []
        if not isinstance(facts, list) or not all(isinstance(f, Mapping) for f in facts):
            raise ValueError(
                f"record {name!r} of run {run!r} holds a {type(facts).__name__}, not a list "
                "of facts (dicts): a Recorder did not write it; remove that name from the "
                "store, or read runs from a store only Recorders write under run/"
            )
        out.append((index, facts))
    return out


def _typed(values: list[Any]) -> Any:
    """A pandas Series for one column, keeping Python types: bools as bools, ints as ints
    (a numpy scalar as the number it holds, an array as it is)."""
    import pandas as pd

    values = [v.item() if type(v).__module__ == "numpy" and v.ndim == 0 else v for v in values]
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

    columns = dict.fromkeys(first)  # in order, each once, in time linear in the keys
    for row in rows:
        columns.update(dict.fromkeys(row))
    return pd.DataFrame({c: _typed([row.get(c) for row in rows]) for c in columns})


_FACT_COLUMNS = ("fact", "forward", "node", "began_us", "took_us", "value", "step", "where")


def facts(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """Every fact of `run`, one row each: fact, forward, node, began_us, took_us, value,
    step, where, then a column per other key a fact carried (a health fact's `inside` and its
    numbers, named by the metric). `where` is filled for a health fact that has none, as
    `node` or `node.inside`. A fact's own `forward` (a crossed fact's bytes) is
    `<fact>.forward`, beside the record's. Records written before health facts were flat,
    with the numbers under "numbers", read the same (a metric named like a column is
    `numbers.<m>`). Missing cells are NA."""
    rows = []
    for index, forward in records(store, run):
        for fact in forward:
            numbers = fact.get("numbers")
            row = {k: v for k, v in fact.items() if k != "numbers" or not isinstance(v, Mapping)}
            if "forward" in row:
                row[f"{fact.get('fact')}.forward"] = row.pop("forward")
            row["forward"] = index
            if fact.get("fact") == "health" and row.get("where") is None:
                node, inside = fact.get("node"), fact.get("inside")
                row["where"] = f"{node}.{inside}" if inside else node
            if isinstance(numbers, Mapping):
                for metric, value in numbers.items():
                    taken = metric in _FACT_COLUMNS or metric in fact
                    row[f"numbers.{metric}" if taken else str(metric)] = value
            rows.append(row)
    return _frame(rows, _FACT_COLUMNS)


def _of_kind(
    store: Store | str | os.PathLike[str], run: str, kind: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    """`(forward, fact)` for every fact of `kind` in `run`, in order."""
    for index, forward in records(store, run):
        for fact in forward:
            if fact.get("fact") == kind:
                yield index, fact


def _table(
    store: Store | str | os.PathLike[str], run: str, kind: str, columns: tuple[str, ...]
) -> pd.DataFrame:
    """A row per fact of `kind` in `run`: `columns` read from the fact, `forward` its index."""
    rows = [
        {c: index if c == "forward" else fact.get(c) for c in columns}
        for index, fact in _of_kind(store, run, kind)
    ]
    return _frame(rows, columns)


def timings(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """How long each node took in each forward of `run`: forward, node, began_us, took_us."""
    return _table(store, run, "ran", ("forward", "node", "began_us", "took_us"))


def losses(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """The loss curve of `run`: one row per loss fact, step and loss."""
    return _table(store, run, "loss", ("step", "value")).rename(columns={"value": "loss"})


def nodes(store: Store | str | os.PathLike[str], run: str) -> pd.DataFrame:
    """A row per node that ran in `run`, in the order they first ran: node, ran (in how
    many forwards), took_us (all of its time added up) and mean_us (per forward)."""
    seen: dict[Any, list[float]] = {}
    for _, fact in _of_kind(store, run, "ran"):
        took = number(fact.get("took_us"))
        seen.setdefault(fact.get("node"), []).append(math.nan if took is None else took)
    rows = [
        {"node": node, "ran": len(t), "took_us": sum(t), "mean_us": sum(t) / len(t)}
        for node, t in seen.items()
    ]
    return _frame(rows, ("node", "ran", "took_us", "mean_us"))


def curve(store: Store | str | os.PathLike[str], run: str, fact: str = "loss") -> pd.DataFrame:
    """How a value went over `run`: a row per fact of kind `fact` (the Trainer's "loss" by
    default, or any fact that carries a "value"): forward, step, value."""
    if not isinstance(fact, str) or not fact:
        raise TypeError(f"fact is the kind of fact to follow, say 'loss', not {fact!r}")
    return _table(store, run, fact, ("forward", "step", "value"))
