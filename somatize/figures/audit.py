"""The live audit: a watcher that draws a run's health while it trains.

    audit = LiveAudit()
    audit                      # show it
    trainer = Trainer(g, objective=..., watching=audit)
    trainer.fit(...)           # the heatmap fills in while this cell runs

It takes `loss` and `health` facts (docs/internals.md, "Facts"), keeps them, and sends what is
new to the browser in batches, at most `1 / interval` times a second, so a fast loop is not
slowed by its own picture.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from somatize.figures._page import STATIC, jsonable, page

__all__ = ["LiveAudit"]


def _verdict_function() -> Any:
    try:
        from somatize.health import verdict
    except ImportError:
        return None
    return verdict


class LiveAudit(anywidget.AnyWidget):
    """A live heatmap of a run's health: rows are the watched places, columns the steps, one
    metric per cell (chosen from a menu); cells the health verdict flags are marked; the loss
    curve runs above on the same steps.

    Call it with facts (pass it as `watching=`); it keeps `loss` and `health` facts and ignores
    the rest. What is new goes to the browser at most every `interval` seconds (and once more
    after the last fact); `sync()` sends now. `frame()` gives what it has seen as a DataFrame.
    """

    _esm = STATIC / "audit.js"
    _css = STATIC / "audit.css"

    metric = traitlets.Unicode("").tag(sync=True)
    metrics = traitlets.List(traitlets.Unicode()).tag(sync=True)
    title = traitlets.Unicode("live audit").tag(sync=True)

    def __init__(
        self,
        *,
        metric: str = "",
        title: str = "live audit",
        interval: float = 0.1,
        verdict: Any = "default",
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval= is seconds between sends and must be > 0, not {interval}")
        super().__init__(metric=metric, title=title)
        self.interval = float(interval)
        self._verdict = _verdict_function() if verdict == "default" else verdict
        self._lock = threading.RLock()
        self._loss: list[tuple[int, float]] = []
        self._cells: dict[
            tuple[str, int], tuple[dict, tuple]
        ] = {}  # (where, step) -> (numbers, flags)
        self._inbox: deque[dict[str, Any]] = deque()  # appended here, drained by a sender
        self._out_loss: list[list[Any]] = []
        self._out_cells: list[list[Any]] = []
        self._seen_metrics: list[str] = []
        self._seen_set: set[str] = set()
        self._last_sent = 0.0
        self._timer: threading.Timer | None = None
        self._seq = 0
        self.sends = 0
        self.on_msg(self._on_message)

    # -- taking facts ---------------------------------------------------------------------
    def __call__(self, fact: dict[str, Any]) -> None:
        """Take one fact; `loss` and `health` facts are kept, others ignored. Cheap: the fact
        is queued as it is and read when the batch goes out."""
        kind = fact.get("fact")
        if kind == "health" or kind == "loss":
            self._inbox.append(fact)
            if time.monotonic() - self._last_sent >= self.interval:
                self._push()
            elif self._timer is None:
                self._arm()

    def flush(self) -> None:
        """What the Trainer calls at the end of a step: send if the interval has passed, else
        make sure what is pending goes out once it has."""
        self._maybe_send()

    def sync(self) -> None:
        """Send everything pending now, whatever the interval."""
        self._push()

    # -- sending --------------------------------------------------------------------------
    def _maybe_send(self) -> None:
        if time.monotonic() - self._last_sent >= self.interval:
            self._push()
        elif self._timer is None:
            self._arm()

    def _arm(self) -> None:
        with self._lock:
            if self._timer is None and self._inbox:
                wait = max(0.0, self.interval - (time.monotonic() - self._last_sent))
                self._timer = threading.Timer(wait, self._push)
                self._timer.daemon = True
                self._timer.start()

    def _take_pending(self) -> None:
        """Move what came in into what is kept, and into the outbox."""
        inbox = []
        while True:
            try:
                inbox.append(self._inbox.popleft())
            except IndexError:
                break
        seen = self._seen_set
        cells, out = self._cells, self._out_cells
        for fact in inbox:
            if fact["fact"] == "loss":
                step = int(fact.get("step", len(self._loss)))
                value = fact["value"]
                self._loss.append((step, value))
                self._out_loss.append([step, _clean(value)])
                continue
            numbers = dict(fact.get("numbers") or {})
            where, step = str(fact["where"]), int(fact["step"])
            for k in numbers:
                if k not in seen:
                    seen.add(k)
                    self._seen_metrics.append(k)
            flags = self._flags(numbers) if self._verdict is not None else []
            kept = cells.get((where, step))
            if kept is None:
                cells[(where, step)] = (numbers, tuple(flags))
            else:  # tuples, not lists: the garbage collector stops looking at them
                cells[(where, step)] = (
                    {**kept[0], **numbers},
                    tuple(sorted(set(kept[1]) | set(flags))),
                )
            out.append([where, step, {k: _clean(v) for k, v in numbers.items()}, flags])

    def _flags(self, numbers: dict[str, Any]) -> list[str]:
        if self._verdict is None:
            return []
        return [str(f) for f in self._verdict(numbers)]

    def _push(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last_sent = time.monotonic()
            self._take_pending()
            if not (self._out_loss or self._out_cells):
                return
            self._seq += 1
            message = {
                "kind": "append",
                "seq": self._seq,
                "loss": self._out_loss,
                "cells": self._out_cells,
            }
            self._out_loss, self._out_cells = [], []
            if list(self.metrics) != self._seen_metrics:
                self.metrics = list(self._seen_metrics)
                if not self.metric:
                    self.metric = self._seen_metrics[0]
            self.send(message)
            self.sends += 1

    def snapshot(self) -> dict[str, Any]:
        """Everything seen so far as one `reset` message: what a page opened late is sent."""
        with self._lock:
            self._take_pending()
            return {
                "kind": "reset",
                "seq": self._seq,
                "loss": [[s, _clean(v)] for s, v in self._loss],
                "cells": [
                    [where, step, {k: _clean(v) for k, v in numbers.items()}, list(flags)]
                    for (where, step), (numbers, flags) in self._cells.items()
                ],
            }

    def _on_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("kind") == "hello":
            with self._lock:
                message = self.snapshot()
                self._out_loss, self._out_cells = [], []
            self.send(message)

    # -- reading back ---------------------------------------------------------------------
    @property
    def loss(self) -> list[tuple[int, float]]:
        """The loss facts seen, as (step, value), including any not yet sent."""
        with self._lock:
            self._take_pending()
            return list(self._loss)

    def frame(self) -> Any:
        """The health facts seen as a pandas DataFrame: one row per (where, step), a column
        per metric, and `flags` (the verdict's, as strings)."""
        import pandas as pd

        with self._lock:
            self._take_pending()
            rows = [
                {"where": where, "step": step, **numbers, "flags": list(flags)}
                for (where, step), (numbers, flags) in self._cells.items()
            ]
        return pd.DataFrame(rows)

    def save_html(self, path: str | Path) -> Path:
        """Write a standalone HTML page with the audit as it stands, drawn offline."""
        path = Path(path)
        state = {"metric": self.metric, "metrics": list(self.metrics), "title": self.title}
        text = page("audit", state, title=self.title, replies=[self.snapshot()])
        path.write_text(text, encoding="utf-8")
        return path


def _clean(value: Any) -> Any:
    """A number as JSON can carry it: a finite float or int as is, NaN and infinities as text."""
    t = type(value)
    if t is float:
        return value if value - value == 0.0 else str(value)
    if t is int or t is bool or value is None:
        return value
    return jsonable(value)
