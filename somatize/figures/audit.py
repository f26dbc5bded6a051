"""The live audit: a watcher that draws a run's health while it trains.

    audit = LiveAudit()
    audit                      # show it
    trainer = Trainer(g, objective=..., watching=audit)
    trainer.fit(...)           # the heatmap fills in while this cell runs

It takes `loss` and `health` facts (docs/internals.md, "Facts"). The training thread does as
little as it can per fact: a health fact is checked (its `where` and `step`), its numbers
copied and put in its place's box; a loss fact goes straight to two arrays. The sender thread, at most
`1 / interval` times a second, turns the boxed facts into columns (per watched place: an array
of steps and an array of values per metric, a whole batch at a time), judges what is new with
the health verdict, and sends the chosen metric's values as binary buffers (the page draws one
metric; choosing another in the menu sends that one's as a reset); every few seconds it also
refreshes `picture`, a compact copy of the heatmap kept as a synced trait, so a saved notebook
or a static page shows what was seen. Whoever reads (`frame()`, `sync()`, a late page's
`hello`) first empties the boxes itself, so what it reads is complete.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from array import array
from bisect import bisect_left
from itertools import chain
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets

from somatize.figures._page import STATIC, jsonable, page
from somatize.figures._screen import MISSING_BITS as _MISSING_BITS
from somatize.figures._screen import screen_of

__all__ = ["LiveAudit"]

# "absent" in a column (a place whose facts do not all carry the same metrics has holes)
_MISSING: float = struct.unpack("<d", struct.pack("<Q", _MISSING_BITS))[0]
_PICTURE_COLUMNS = 240  # the page bins past this many steps anyway
_PICTURE_LOSS = 1000


def _verdict_function() -> Any:
    try:
        from somatize.health import verdict
    except ImportError:
        return None
    return verdict


class _Place:
    """What one watched place has seen: row i is one health fact (its step, its numbers)."""

    __slots__ = ("appends", "cols", "flag_rows", "flags", "judged", "keys", "odd", "sent", "steps")

    def __init__(self) -> None:
        self.steps = array("q")
        self.cols: dict[str, array] = {}  # metric -> one value per row (_MISSING where absent)
        self.keys: tuple | None = ()  # the metrics of a fact that takes the quick path
        self.appends: list[Any] = []  # their columns' `append`, in that order
        self.odd: dict[tuple[int, str], Any] = {}  # (row, metric) -> a value that is no number
        self.flags: dict[int, list[str]] = {}  # row -> the verdict's flags, where it raised any
        self.flag_rows: list[int] = []  # the rows in `flags`, ascending (judged in order)
        self.judged = 0  # rows the verdict has read
        self.sent = 0  # rows sent to the browser

    def complete(self) -> tuple[int, list[tuple[str, array]]]:
        """How many rows there are, and the columns. Rows are filled by whoever holds the
        audit's lock (the sender, or a reader emptying the queue), so under it every row is
        whole."""
        return len(self.steps), list(self.cols.items())


class LiveAudit(anywidget.AnyWidget):
    """A live heatmap of a run's health: rows are the watched places, columns the steps, one
    metric per cell (chosen from a menu); cells the health verdict flags are marked; the loss
    curve runs above on the same steps.

    Call it with facts (pass it as `watching=`); it keeps `loss` and `health` facts and ignores
    the rest. What is new goes to the browser at most every `interval` seconds (0.25 by
    default), from a sender thread (and once more after the last fact); `sync()` sends now. A
    fact is handed over as it is when taken (its numbers are copied). `frame()` and `loss` give
    what it has seen, `metrics` the metrics the facts carried, all current as soon as a fact is
    taken. The page is sent the chosen `metric`'s values (and every flag); choosing another
    sends that one's. `picture` is a compact copy of the heatmap for the chosen metric (at most
    240 step columns), refreshed every `picture_every` seconds and when the facts stop: what a
    page without a kernel draws. A fact
    without `where` or with a step that is not an integer is refused (ValueError) and nothing
    of it is kept.
    """

    _esm = STATIC / "audit.js"
    _css = STATIC / "audit.css"

    metric = traitlets.Unicode("").tag(sync=True)
    metrics = traitlets.List(traitlets.Unicode()).tag(sync=True)
    title = traitlets.Unicode("live audit").tag(sync=True)
    picture = traitlets.Dict().tag(sync=True)

    def __init__(
        self,
        *,
        metric: str = "",
        title: str = "live audit",
        interval: float = 0.25,
        verdict: Any = "default",
        picture_every: float = 3.0,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval= is seconds between sends and must be > 0, not {interval}")
        if not picture_every > 0:
            raise ValueError(f"picture_every= is seconds and must be > 0, not {picture_every}")
        super().__init__(metric=metric, title=title)
        self.interval = float(interval)
        self.picture_every = float(picture_every)
        self._verdict = _verdict_function() if verdict == "default" else verdict
        self._screen = screen_of(self._verdict)
        self._lock = threading.RLock()
        self._places: dict[str, _Place] = {}
        # health facts taken but not yet in columns, per place: the `append`s of a list of
        # numbers and of a list of steps. The training thread appends (numbers first); whoever
        # holds the lock takes what is there (list slices and appends are atomic)
        self._boxes: dict[str, tuple[Any, Any]] = {}
        self._keys: set[Any] = set()  # every metric key seen (as given): the quick check
        self._loss_steps = array("q")
        self._loss_values = array("d")
        self._loss_sent = 0
        self._seen: list[str] = []  # metrics, in the order first seen
        self._rows = 0  # health facts turned into columns
        self._pictured: tuple[int, int] = (-1, -1)  # (rows, losses) in the last picture
        self._pictured_at = 0.0
        self._idle = True
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.sends = 0  # messages sent
        self.pictures = 0  # times `picture` was refreshed
        self.on_msg(self._on_message)

    # -- taking facts ---------------------------------------------------------------------
    def __call__(self, fact: dict[str, Any]) -> None:
        """Take one fact: `loss` and `health` facts are kept, others ignored. A health fact is
        checked here (a bad one raises ValueError, nothing of it kept) and boxed, its numbers
        copied; the sender thread turns the boxes into columns and sends."""
        kind = fact.get("fact")
        if kind == "health":
            where, step, numbers = fact.get("where"), fact.get("step"), fact.get("numbers")
            if type(where) is not str or type(step) is not int or type(numbers) is not dict:
                where, step, numbers = _checked(fact)
            box = self._boxes.get(where)
            if box is None:
                box = self._box(where)
            if not numbers.keys() <= self._keys:
                self._new_metrics(numbers)
            box[0](numbers.copy())
            box[1](step)
        elif kind == "loss":
            value, step = fact.get("value"), fact.get("step")
            if type(step) is not int:
                step = len(self._loss_steps) if step is None else _integer(step, fact)
            if type(value) is not float:
                value = _number(value)
            self._loss_steps.append(step)
            self._loss_values.append(value)
        else:
            return
        if self._idle:
            self._wake()

    def _waiting(self) -> bool:
        """Whether a health fact waits in a box."""
        return any(len(box[1].__self__) for box in list(self._boxes.values()))

    def _box(self, where: str) -> tuple[Any, Any]:
        with self._lock:
            box = self._boxes.get(where)
            if box is None:
                box = self._boxes[where] = ([].append, [].append)
            return box

    def _new_metrics(self, numbers: dict) -> None:
        """A fact with a metric not seen before: `metrics` (and `metric`, if none was chosen)
        are brought up to date now, in the caller's thread."""
        with self._lock:
            new = False
            for k in numbers:
                name = str(k)
                if name not in self._seen:
                    self._seen.append(name)
                    new = True
                self._keys.add(k)
            if new:
                self.metrics = list(self._seen)
                if not self.metric:
                    self.metric = self._seen[0]

    def _drain(self) -> None:
        """Turn the facts waiting in the boxes into columns, a place's facts at a time (call
        with the lock held)."""
        for where, (put_numbers, put_step) in list(self._boxes.items()):
            steps, dicts = put_step.__self__, put_numbers.__self__
            n = len(steps)  # the numbers of each of these are in (appended first)
            if not n:
                continue
            taken_steps, taken = steps[:n], dicts[:n]
            del steps[:n], dicts[:n]
            place = self._places.get(where)
            if place is None:
                place = self._places[where] = _Place()
            self._fill(place, taken_steps, taken)
            self._rows += n

    def _fill(self, place: _Place, steps: list[int], dicts: list[dict]) -> None:
        """Append one place's facts: when they all carry the place's metrics, in its order, and
        every value is a float, column by column (no Python per number); else fact by fact."""
        if tuple(dicts[0]) != place.keys:
            self._one(place, steps[0], dicts[0])
            steps, dicts = steps[1:], dicts[1:]
        keys = place.keys
        # every fact's keys are the place's, in order: the keys one after another are the
        # place's keys n times over (no dict holds a key twice, so none is shorter or longer)
        if dicts and keys is not None and list(chain.from_iterable(dicts)) == [*keys] * len(dicts):
            values = list(chain.from_iterable(map(dict.values, dicts)))
            if set(map(type, values)) <= _FLOATS:
                flat = array("d", values)
                k = len(keys)
                for j, append in enumerate(place.appends):
                    append.__self__.extend(flat[j::k])
                place.steps.extend(steps)
                return
        for step, numbers in zip(steps, dicts, strict=True):
            self._one(place, step, numbers)

    def _one(self, place: _Place, step: int, numbers: dict) -> None:
        """Append one fact to its place's columns."""
        if tuple(numbers) == place.keys:  # the same metrics as before, in the same order
            place.steps.append(step)
            # as long: the same keys (strict= would only cost time)
            for append, v in zip(place.appends, numbers.values(), strict=False):
                if type(v) is float:
                    append(v)
                else:
                    append(self._odd(place, append.__self__, v))
        else:
            self._row(place, step, numbers)

    def _odd(self, place: _Place, col: array, value: Any) -> float:
        """A value that is not a float: an int or a numeric scalar as a float, anything else
        (a bool, a string, None) kept aside, the column holding 'absent'."""
        if not isinstance(value, bool):
            try:
                return float(value)
            except (TypeError, ValueError):
                pass
        name = next((k for k, c in place.cols.items() if c is col), None)
        if name is not None:
            place.odd[(len(col), name)] = value
        return _MISSING

    def _row(self, place: _Place, step: int, numbers: dict) -> None:
        """A fact whose metrics differ from its place's last: new columns, holes filled."""
        row = len(place.steps)
        names = [str(k) for k in numbers]
        for name in names:
            if name not in place.cols:
                place.cols[name] = array("d", [_MISSING]) * row
        order = [place.cols[name] for name in names]
        place.steps.append(step)
        for col, v in zip(order, numbers.values(), strict=True):
            col.append(v if type(v) is float else self._odd(place, col, v))
        given = set(names)
        for name, col in place.cols.items():
            if name not in given:
                col.append(_MISSING)
        # the quick path only for facts that fill every column
        whole = len(given) == len(place.cols) and len(names) == len(numbers)
        place.keys = tuple(numbers) if whole else None
        place.appends = [col.append for col in order]

    def flush(self) -> None:
        """What the Trainer calls at the end of a step. Nothing to do: the sender thread sends
        at most every `interval` seconds, and once more when the facts stop."""

    def sync(self) -> None:
        """Send everything pending now, and refresh `picture`, whatever the interval."""
        with self._lock:
            self._push()
            self._paint()

    # -- sending --------------------------------------------------------------------------
    def _wake(self) -> None:
        with self._lock:
            if self._idle:
                self._idle = False
                self._thread = threading.Thread(
                    target=self._run, name="somatize-live-audit", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        try:
            self._rounds()
        except BaseException:
            with self._lock:  # a later fact starts another sender instead of none
                self._idle, self._thread = True, None
            raise

    def _rounds(self) -> None:
        while True:
            time.sleep(self.interval)
            with self._lock:
                fresh = self._push()
                now = (self._rows, len(self._loss_steps))
                quiet = not fresh
                if self._pictured != now and (
                    quiet or time.monotonic() - self._pictured_at >= self.picture_every
                ):
                    self._paint()
                if quiet and self._pictured == now:
                    self._idle = True
                    # a fact taken from here on sees `_idle` and starts a sender of its own
                    if not self._waiting() and len(self._loss_steps) == now[1]:
                        self._thread = None
                        return
                    self._idle = False  # a fact came in meanwhile: go on

    def _judge(self, place: _Place, n: int, cols: list[tuple[str, array]]) -> None:
        """Run the verdict over rows not yet judged (only those the screen cannot clear)."""
        lo = place.judged
        if self._verdict is None or n <= lo:
            place.judged = max(lo, n)
            return
        views = {name: np.frombuffer(col[lo:n], dtype=np.float64) for name, col in cols}
        rows = self._screen(views, n - lo)
        if place.odd:
            extra = {r - lo for r, _ in place.odd if lo <= r < n}
            rows = sorted(set(rows.tolist()) | extra) if extra else rows.tolist()
        else:
            rows = rows.tolist()
        for i in rows:
            numbers = {}
            for name, view in views.items():
                v = float(view[i])
                if v != v and struct.pack("<d", v) == _MISSING_PACKED:
                    odd = place.odd.get((lo + i, name), _ABSENT)
                    if odd is not _ABSENT:
                        numbers[name] = odd
                    continue
                numbers[name] = v
            flags = [str(f) for f in self._verdict(numbers)]
            if flags:
                place.flags[lo + i] = flags
                place.flag_rows.append(lo + i)
        place.judged = n

    def _take(
        self, everything: bool, only: str | None = None, buffers: list | None = None
    ) -> dict[str, Any]:
        """What is new (or everything) in the columnar shape the page reads; with `only`, the
        values of that metric alone (what the page draws), flags and steps all the same. With
        `buffers` (a list), values go there as binary and steps in a row as a run."""
        self._drain()
        nl = min(len(self._loss_steps), len(self._loss_values))
        l0 = 0 if everything else self._loss_sent
        loss = [
            _steps(self._loss_steps, l0, nl, buffers is not None),
            _column(self._loss_values, l0, nl, buffers),
        ]
        self._loss_sent = nl
        places = []
        for where, place in list(self._places.items()):
            n, cols = place.complete()
            self._judge(place, n, cols)
            lo = 0 if everything else place.sent
            place.sent = n
            if n <= lo:
                continue
            values = {
                name: _column(col, lo, n, buffers, place.odd, name)
                for name, col in cols
                if only is None or name == only
            }
            rows = place.flag_rows
            flags = [[r - lo, place.flags[r]] for r in rows[bisect_left(rows, lo) :] if r < n]
            places.append([where, _steps(place.steps, lo, n, buffers is not None), values, flags])
        return {"loss": loss, "places": places, "metrics": list(self._seen)}

    def _push(self) -> bool:
        """Send what is new as one `append` message; whether there was anything."""
        buffers: list[memoryview] = []
        l0 = self._loss_sent
        taken = self._take(everything=False, only=self.metric, buffers=buffers)
        if not (self._loss_sent > l0 or taken["places"]):
            return False
        self._seq += 1
        self.send({"kind": "append", "seq": self._seq, **taken}, buffers)
        self.sends += 1
        return True

    def _paint(self) -> None:
        """Refresh `picture`: everything seen of the chosen metric, binned to at most 240 steps
        per place (a bin shows its last row and every flag in it), the loss to at most 1000
        points."""
        self._take_judged()
        loss_n = min(len(self._loss_steps), len(self._loss_values))
        keep = _thinned(loss_n, _PICTURE_LOSS)
        loss = [
            np.frombuffer(self._loss_steps[:loss_n], dtype=np.int64)[keep].tolist(),
            _json_column(array("d", np.frombuffer(self._loss_values[:loss_n])[keep]), 0, len(keep)),
        ]
        places = []
        for where, place in list(self._places.items()):
            n = place.judged
            per = max(1, -(-n // _PICTURE_COLUMNS))
            last = np.minimum(np.arange(per - 1, n + per - 1, per), n - 1)
            values = {
                name: _json_column(array("d", np.frombuffer(col[:n])[last]), 0, len(last))
                for name, col in list(place.cols.items())
                if name == self.metric
            }
            binned: dict[int, set[str]] = {}
            for r, f in list(place.flags.items()):
                if r < n:
                    binned.setdefault(r // per, set()).update(f)
            flags = [[b, sorted(f)] for b, f in sorted(binned.items())]
            steps = np.frombuffer(place.steps[:n], dtype=np.int64)[last].tolist()
            places.append([where, steps, values, flags])
        self.picture = {
            "kind": "reset",
            "seq": self._seq,
            "loss": loss,
            "places": places,
            "metrics": list(self._seen),
        }
        self._pictured = (self._rows, loss_n)
        self._pictured_at = time.monotonic()
        self.pictures += 1

    def _take_judged(self) -> None:
        self._drain()
        for place in list(self._places.values()):
            n, cols = place.complete()
            self._judge(place, n, cols)

    def snapshot(self) -> dict[str, Any]:
        """Everything seen so far as one `reset` message: what a page opened late is sent."""
        with self._lock:
            loss_sent = self._loss_sent
            sent = {w: p.sent for w, p in self._places.items()}
            message = {"kind": "reset", "seq": self._seq, **self._take(everything=True)}
            self._loss_sent = loss_sent  # what was not sent yet still goes in the next append
            for w, p in self._places.items():
                p.sent = sent.get(w, 0)
            return message

    def _on_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("kind") == "hello":
            self._reset()

    def _reset(self) -> None:
        """Send the page everything seen of the chosen metric, as one `reset` message."""
        with self._lock:
            buffers: list[memoryview] = []
            taken = self._take(everything=True, only=self.metric, buffers=buffers)
            self.send({"kind": "reset", "seq": self._seq, **taken}, buffers)

    @traitlets.observe("metric")
    def _metric_changed(self, _change: Any) -> None:
        # the page holds the chosen metric's values only: another metric's come as a reset
        # (and the picture is redrawn with them); nothing to do before anything was sent
        if getattr(self, "_lock", None) is None:
            return
        with self._lock:
            if self._seq or self._loss_sent or any(p.sent for p in self._places.values()):
                self._reset()
            if self._pictured[0] >= 0:
                self._paint()

    # -- reading back ---------------------------------------------------------------------
    @property
    def loss(self) -> list[tuple[int, float]]:
        """The loss facts seen, as (step, value), including any not yet sent."""
        n = min(len(self._loss_steps), len(self._loss_values))
        return list(zip(self._loss_steps[:n].tolist(), self._loss_values[:n].tolist(), strict=True))

    def frame(self) -> Any:
        """The health facts seen as a pandas DataFrame: one row per (where, step), a column
        per metric (NaN where a fact did not carry it), and `flags` (the verdict's, as
        strings). Two facts for one place and step are merged, the later's numbers winning."""
        import pandas as pd

        with self._lock:
            self._take_judged()
            parts = []
            for where, place in list(self._places.items()):
                n = place.judged
                data: dict[str, Any] = {"where": [where] * n, "step": place.steps[:n].tolist()}
                for name, col in list(place.cols.items()):
                    a = np.frombuffer(col[:n], dtype=np.float64).copy()
                    if place.odd:
                        column: Any = a.tolist()
                        for (r, m), v in place.odd.items():
                            if m == name and r < n:
                                column[r] = v
                        data[name] = column
                    else:
                        data[name] = a
                data["flags"] = [list(place.flags.get(r, ())) for r in range(n)]
                part = pd.DataFrame(data)
                if part["step"].duplicated().any():
                    part = _merged(part)
                parts.append(part)
        if not parts:
            return pd.DataFrame(columns=["where", "step", "flags"])
        frame = pd.concat(parts, ignore_index=True)
        return frame[[c for c in frame.columns if c != "flags"] + ["flags"]]

    def save_html(self, path: str | Path) -> Path:
        """Write a standalone HTML page with the audit as it stands, drawn offline."""
        path = Path(path)
        state = {"metric": self.metric, "metrics": list(self.metrics), "title": self.title}
        text = page("audit", state, title=self.title, replies=[self.snapshot()])
        path.write_text(text, encoding="utf-8")
        return path


_ABSENT = object()
_MISSING_PACKED = struct.pack("<d", _MISSING)
_FLOATS = {float}


def _checked(fact: dict[str, Any]) -> tuple[str, int, dict]:
    where, numbers = fact.get("where"), fact.get("numbers")
    if where is None:
        raise ValueError(f"a health fact names its place in 'where'; this one does not: {fact!r}")
    if numbers is None:
        numbers = {}
    if not isinstance(numbers, dict):
        try:
            numbers = dict(numbers)
        except (TypeError, ValueError):
            raise ValueError(
                f"a health fact's 'numbers' is a dict of metric -> number, not {numbers!r}"
            ) from None
    return str(where), _integer(fact.get("step"), fact), numbers


def _integer(step: Any, fact: dict[str, Any]) -> int:
    try:
        if isinstance(step, bool) or float(step) != int(step):
            raise ValueError
        return int(step)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"a fact's 'step' is an integer, not {step!r} (in {fact!r})") from None


def _thinned(n: int, most: int) -> np.ndarray:
    """At most about `most` evenly spaced indices of range(n), the last one always in."""
    keep = np.arange(0, n, max(1, -(-n // most)))
    if n and keep[-1] != n - 1:
        keep = np.append(keep, n - 1)
    return keep


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _steps(steps: array, lo: int, hi: int, compact: bool) -> Any:
    """Steps lo:hi as a list, or (`compact`) as `{"run": [first, count]}` when each is one more
    than the last (the usual case: one fact per place per step)."""
    part = steps[lo:hi]
    if compact and len(part) > 1:
        a = np.frombuffer(part, dtype=np.int64)
        if a[-1] - a[0] == len(a) - 1 and bool((np.diff(a) == 1).all()):
            return {"run": [int(a[0]), len(a)]}
    return part.tolist()


def _column(
    col: array,
    lo: int,
    hi: int,
    buffers: list | None,
    odd: dict | None = None,
    name: str | None = None,
) -> Any:
    """Values lo:hi: as JSON (`_json_column`) without `buffers`; else appended to `buffers` as
    little-endian float64 (a hole keeps its NaN payload, a measured NaN or infinity is itself)
    and named by index: `{"buffer": i}`, with `"odd": [[row, value]...]` for values kept
    aside."""
    if buffers is None:
        return _json_column(col, lo, hi, odd, name)
    part = col[lo:hi]
    if _BIG_ENDIAN:
        part.byteswap()
    out: dict[str, Any] = {"buffer": len(buffers)}
    buffers.append(memoryview(part).cast("B"))
    if odd:
        kept = [[r - lo, jsonable(v)] for (r, m), v in odd.items() if m == name and lo <= r < hi]
        if kept:
            out["odd"] = kept
    return out


_BIG_ENDIAN = sys.byteorder == "big"


def _json_column(
    col: array, lo: int, hi: int, odd: dict | None = None, name: str | None = None
) -> list[Any]:
    """Values lo:hi as JSON can carry them: numbers, "nan"/"inf"/"-inf", None where absent
    (or the odd value kept aside, made plain)."""
    a = np.frombuffer(col[lo:hi], dtype=np.float64)
    out = a.tolist()
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        bits = a.view(np.uint64)
        for i in bad.tolist():
            if int(bits[i]) == _MISSING_BITS:
                v = odd.get((lo + i, name), _ABSENT) if odd else _ABSENT
                out[i] = None if v is _ABSENT else jsonable(v)
            else:
                out[i] = str(out[i])
    return out


def _merged(part: Any) -> Any:
    """Rows of one place with the same step folded into one: later numbers win where given,
    flags joined."""
    rows: dict[int, dict[str, Any]] = {}
    for record in part.to_dict("records"):
        had = rows.get(record["step"])
        if had is None:
            rows[record["step"]] = record
            continue
        for k, v in record.items():
            if k == "flags":
                had[k] = sorted(set(had[k]) | set(v))
            elif not (isinstance(v, float) and v != v) or k not in had:
                had[k] = v
    import pandas as pd

    return pd.DataFrame(list(rows.values()))
