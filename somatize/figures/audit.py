"""The live audit: a watcher that draws a run's health while it trains.

    audit = LiveAudit()
    audit                      # show it
    trainer = Trainer(g, objective=..., watching=audit)
    trainer.fit(...)           # the heatmap fills in while this cell runs

It takes `loss` and `health` facts (docs/internals.md, "Facts"). The training thread does as
little as it can per fact: a health fact is checked (its `where` and `step`) and, when it
carries the metrics of its place's last fact, its values are put in its place's box (a list
`extend`); a loss fact goes straight to two arrays. The sender thread, at most
`1 / interval` times a second, turns the boxed facts into columns (per watched place: an array
of steps and an array of values per metric, a whole batch at a time), judges what is new with
the health verdict, and sends the chosen metric's values as binary buffers (the page draws one
metric; choosing another in the menu sends that one's as a reset); every few seconds it also
refreshes `picture`, a compact copy of the heatmap kept as a synced trait, so a saved notebook
or a static page shows what was seen. Whoever reads (`frame()`, `sync()`, a late page's
`hello`) first empties the boxes itself, so what it reads is complete.
"""

from __future__ import annotations

import base64
import struct
import sys
import threading
import time
from array import array
from bisect import bisect_left
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets

from somatize.figures._page import STATIC, jsonable, page
from somatize.figures._screen import ALARMS, FALSE_BITS, TRUE_BITS, screen_of
from somatize.figures._screen import MISSING_BITS as _MISSING_BITS

__all__ = ["LiveAudit"]

# "absent" in a column (a place whose facts do not all carry the same metrics has holes)
_MISSING: float = struct.unpack("<d", struct.pack("<Q", _MISSING_BITS))[0]
# a bool in a column: NaNs with payloads of their own (8 bytes a value, nothing kept aside),
# indexed by the bool
_BOOL_FLOATS = tuple(struct.unpack("<d", struct.pack("<Q", b))[0] for b in (FALSE_BITS, TRUE_BITS))
_STEP_RANGE = range(-(1 << 63), 1 << 63)  # what an array("q") of steps holds
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

    __slots__ = ("alarms", "cols", "flag_rows", "flags", "judged", "odd", "sent", "steps")

    def __init__(self) -> None:
        self.steps = array("q")
        self.cols: dict[str, array] = {}  # metric -> one value per row (_MISSING where absent)
        # (row, metric) -> a value that is neither a number nor a bool (bools are in the columns)
        self.odd: dict[tuple[int, str], Any] = {}
        self.alarms: list[int] = []  # rows (ascending) with a True under ALARMS (nan, inf)
        self.flags: dict[int, list[str]] = {}  # row -> the verdict's flags, where it raised any
        self.flag_rows: list[int] = []  # the rows in `flags`, ascending (judged in order)
        self.judged = 0  # rows the verdict has read
        self.sent = 0  # rows sent to the browser

    def complete(self) -> tuple[int, list[tuple[str, array]]]:
        """How many rows there are, and the columns. Rows are filled by whoever holds the
        audit's lock (the sender, or a reader emptying the queue), so under it every row is
        whole."""
        return len(self.steps), list(self.cols.items())


class _Box:
    """One place's health facts taken but not yet in columns, all with the metrics `keys` (in
    that order): their values one fact after another, and their steps. The training thread
    puts a fact's values, then marks its step; whoever holds the audit's lock takes the first
    len(steps) facts (list appends, slices and deletions are atomic). `keys` changes only in
    the caller's thread, under the lock, once the box is empty."""

    __slots__ = ("keys", "mark", "put", "steps", "values")

    def __init__(self) -> None:
        self.keys: tuple = ()
        self.values: list[Any] = []
        self.steps: list[int] = []
        self.put = self.values.extend
        self.mark = self.steps.append


class LiveAudit(anywidget.AnyWidget):
    """A live heatmap of a run's health: rows are the watched places, columns the steps, one
    metric per cell (chosen from a menu); cells the health verdict flags are marked; the loss
    curve runs above on the same steps.

    Call it with facts (pass it as `watching=`); it keeps `loss` and `health` facts and ignores
    the rest. What is new goes to the browser at most every `interval` seconds (0.25 by
    default), from a sender thread (and once more after the last fact); `sync()` sends now. A
    fact is kept as it is when taken (its values are read then). `frame()` and `loss` give
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
        # health facts taken but not yet in columns, per place (see _Box)
        self._boxes: dict[str, _Box] = {}
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
        checked here (a bad one raises ValueError, nothing of it kept) and its values boxed
        (read now: the caller may reuse its dict); the sender thread turns the boxes into
        columns and sends."""
        kind = fact.get("fact")
        if kind == "health":
            if "numbers" not in fact and "node" in fact:  # the flat layout (contract 1)
                from somatize.health import numbers_of, where_of

                fact = {
                    "where": where_of(fact),
                    "step": fact.get("step"),
                    "numbers": numbers_of(fact),
                }
            where, step, numbers = fact.get("where"), fact.get("step"), fact.get("numbers")
            if (
                type(where) is not str
                or type(step) is not int
                or type(numbers) is not dict
                or step not in _STEP_RANGE
            ):
                where, step, numbers = _checked(fact)
            box = self._boxes.get(where)
            # the usual case: the metrics of this place's last fact, in the same order
            if box is not None and tuple(numbers) == box.keys:
                box.put(numbers.values())
                box.mark(step)
            else:
                self._other(where, step, numbers)
        elif kind == "loss":
            value, step = fact.get("value"), fact.get("step")
            if type(step) is not int or step not in _STEP_RANGE:
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
        return any(box.steps for box in list(self._boxes.values()))

    def _other(self, where: str, step: int, numbers: dict) -> None:
        """A health fact whose metrics are not its place's last (or its place's first): what
        is boxed goes into columns first, then this fact, in the caller's thread; its metrics
        become the box's. A metric never seen before updates `metrics` here."""
        with self._lock:
            new = [name for name in map(str, numbers) if name not in self._seen]
            box = self._boxes.get(where)
            if box is None:
                box = self._boxes[where] = _Box()
                self._places[where] = _Place()
            self._empty(self._places[where], box)
            self._row(self._places[where], step, numbers)
            self._rows += 1
            box.keys = tuple(numbers)
            if new:
                self._seen.extend(new)
                self.metrics = list(self._seen)
                if not self.metric:
                    self.metric = self._seen[0]

    def _drain(self) -> None:
        """Turn the facts waiting in the boxes into columns (call with the lock held)."""
        for where, box in list(self._boxes.items()):
            if box.steps:
                self._empty(self._places[where], box)

    def _empty(self, place: _Place, box: _Box) -> None:
        """Append a box's facts to its place's columns, a batch at a time: when every value is
        a float by a few C-level passes (one `array('d')` of all values, a strided `extend`
        per column, holes for the columns the box's metrics leave out); else column by column
        (floats and ints at once, a column of bools at once as NaNs with payloads, anything
        else value by value)."""
        steps = box.steps
        n = len(steps)  # the values of each of these are in (they are put first)
        if not n:
            return
        keys = box.keys
        k = len(keys)
        taken_steps, values = steps[:n], box.values[: n * k]
        del steps[:n], box.values[: n * k]
        self._rows += n
        names = [str(key) for key in keys]
        cols = [place.cols[name] for name in names]
        given = set(names)
        others = [col for name, col in place.cols.items() if name not in given]
        alarms = len(place.alarms)
        if set(map(type, values)) <= _FLOATS:
            flat = array("d", values)
            for j, col in enumerate(cols):
                col.extend(flat[j::k])
        else:  # column by column: floats and ints at once, anything else value by value
            types = list(map(type, values))
            for j, col in enumerate(cols):
                column = values[j::k]
                kinds = set(types[j::k])
                if kinds <= _NUMBERS:
                    try:
                        col.extend(array("d", column))
                        continue
                    except OverflowError:  # an int past float's range: value by value
                        pass
                elif kinds == _BOOLS:  # as NaNs with a payload for each bool
                    name, row = names[j], len(col)
                    if name in ALARMS and True in column:
                        place.alarms += [row + i for i, v in enumerate(column) if v is True]
                    col.extend(array("d", map(_BOOL_FLOATS.__getitem__, column)))
                    continue
                for v in column:
                    col.append(v if type(v) is float else self._odd(place, col, v, names[j]))
        if others:
            holes = _HOLE * n
            for col in others:
                col.extend(holes)
        place.steps.extend(taken_steps)
        if len(place.alarms) > alarms:
            _ordered(place.alarms, alarms)

    def _odd(self, place: _Place, col: array, value: Any, name: str) -> float:
        """A value that is not a float for `col` (metric `name`): an int or a numeric scalar
        as a float, a bool as its own NaN, anything else (a string, None, an int past float's
        range) kept aside, the column holding 'absent'."""
        row = len(col)
        if isinstance(value, bool):
            if value and name in ALARMS:
                place.alarms.append(row)  # put in order by _ordered
            return _BOOL_FLOATS[value]
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            pass
        place.odd[(row, name)] = value
        return _MISSING

    def _row(self, place: _Place, step: int, numbers: dict) -> None:
        """A fact whose metrics differ from its place's last: new columns, holes filled."""
        alarms = len(place.alarms)
        row = len(place.steps)
        names = [str(k) for k in numbers]
        for name in names:
            if name not in place.cols:
                place.cols[name] = array("d", [_MISSING]) * row
        order = [place.cols[name] for name in names]
        place.steps.append(step)
        for col, name, v in zip(order, names, numbers.values(), strict=True):
            col.append(v if type(v) is float else self._odd(place, col, v, name))
        given = set(names)
        for name, col in place.cols.items():
            if name not in given:
                col.append(_MISSING)
        if len(place.alarms) > alarms:
            _ordered(place.alarms, alarms)

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
        rows = self._screen(views, n - lo).tolist()
        if place.alarms:
            # the bools the screen cannot see: for the default verdict only a True under
            # ALARMS can raise a flag; any other verdict reads every row anyway
            alarms = place.alarms
            extra = {r - lo for r in alarms[bisect_left(alarms, lo) :] if r < n}
            if extra:
                rows = sorted(set(rows) | extra)
        for i in rows:
            numbers = {}
            for name, view in views.items():
                v = float(view[i])
                if v != v:
                    special = _special(v, place.odd, lo + i, name)
                    if special is not _NUMBER:
                        if special is not _ABSENT:
                            numbers[name] = special
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
            _b64(np.frombuffer(self._loss_steps[:loss_n], dtype=np.int64)[keep]),
            _b64(np.frombuffer(self._loss_values[:loss_n])[keep]),
        ]
        places = []
        for where, place in list(self._places.items()):
            n = place.judged
            per = max(1, -(-n // _PICTURE_COLUMNS))
            last = np.minimum(np.arange(per - 1, n + per - 1, per), n - 1)
            values = {
                name: _b64(_holes_for_bools(np.frombuffer(col[:n])[last]))
                for name, col in list(place.cols.items())
                if name == self.metric
            }
            binned: dict[int, set[str]] = {}
            for r, f in list(place.flags.items()):
                if r < n:
                    binned.setdefault(r // per, set()).update(f)
            flags = [[b, sorted(f)] for b, f in sorted(binned.items())]
            steps = _b64(np.frombuffer(place.steps[:n], dtype=np.int64)[last])
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
                aside: dict[str, list[tuple[int, Any]]] = {}
                for (r, m), v in place.odd.items():
                    if r < n:
                        aside.setdefault(m, []).append((r, v))
                for name, col in list(place.cols.items()):
                    a = np.frombuffer(col[:n], dtype=np.float64).copy()
                    bools = _bools_in(a)
                    if name in aside or bools.size:
                        column: Any = a.tolist()
                        for r, v in aside.get(name, ()):
                            column[r] = v
                        for r in bools.tolist():
                            column[r] = _special(column[r], None, r, name)
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
_NUMBER = object()
_UNPACK_BITS = struct.Struct("<Q").unpack
_PACK_FLOAT = struct.Struct("<d").pack
_FLOATS = {float}
_NUMBERS = {float, int}
_BOOLS = {bool}
_HOLE = array("d", [_MISSING])


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
        if isinstance(step, bool) or (not isinstance(step, int) and float(step) != int(step)):
            raise ValueError
        step = int(step)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"a fact's 'step' is an integer, not {step!r} (in {fact!r})") from None
    if step not in _STEP_RANGE:
        raise ValueError(
            f"a fact's 'step' must fit in 64 bits (-2**63 to 2**63 - 1), not {step!r} "
            f"(in {fact!r}); count steps from 0"
        )
    return step


def _special(v: float, odd: dict | None, row: int, name: str | None) -> Any:
    """What a NaN in a column stands for: a bool (its payload says which), something kept
    aside in `odd` at (row, name), `_ABSENT` for a hole with nothing kept, `_NUMBER` for a
    measured NaN."""
    bits = _UNPACK_BITS(_PACK_FLOAT(v))[0]
    if bits == _MISSING_BITS:
        return odd.get((row, name), _ABSENT) if odd else _ABSENT
    if bits == TRUE_BITS:
        return True
    if bits == FALSE_BITS:
        return False
    return _NUMBER


def _bools_in(a: np.ndarray) -> np.ndarray:
    """Indices of the bools (NaNs with FALSE_BITS or TRUE_BITS) in a float64 column."""
    d = a.view(np.uint64) - np.uint64(FALSE_BITS)  # wraps below FALSE_BITS: not a bool
    return np.flatnonzero(d <= np.uint64(TRUE_BITS - FALSE_BITS))


def _holes_for_bools(a: np.ndarray) -> np.ndarray:
    """`a` with its bools as holes (what a page shows where a column holds no number)."""
    at = _bools_in(a)
    if at.size:
        a = a.copy()
        a.view(np.uint64)[at] = _MISSING_BITS
    return a


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


def _ordered(rows: list[int], start: int) -> None:
    """Rows added from `start` on (all past the earlier ones, added column by column), sorted
    and each once, so the list stays ascending."""
    rows[start:] = sorted(set(rows[start:]))


def _b64(a: np.ndarray) -> dict[str, str]:
    """Numbers as little-endian float64, base64 text: `{"b64": ...}`. What `picture` holds:
    a synced trait is walked element by element and serialised as JSON, one string is not."""
    return {"b64": base64.b64encode(a.astype("<f8").tobytes()).decode("ascii")}


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
    a = np.frombuffer(part, dtype="<u8")
    kept = []
    if odd:
        for i in np.flatnonzero(a == _MISSING_BITS).tolist():
            v = odd.get((lo + i, name), _ABSENT)
            if v is not _ABSENT:
                kept.append([i, jsonable(v)])
    bools = _bools_in(a.view("<f8"))
    if bools.size:  # sent as holes, each with its bool beside
        kept += [[i, bool(a[i] == TRUE_BITS)] for i in bools.tolist()]
        a[bools] = _MISSING_BITS
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
    for i in bad.tolist():
        v = _special(out[i], odd, lo + i, name) if out[i] != out[i] else _NUMBER
        if v is _NUMBER:
            out[i] = str(out[i])  # a measured NaN or infinity
        else:
            out[i] = None if v is _ABSENT else jsonable(v)
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
