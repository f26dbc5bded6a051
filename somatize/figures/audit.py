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
        self._cells: dict[tuple[str, int], list[Any]] = {}  # (where, step) -> [numbers, flags]
        self._pending_loss: list[tuple[int, float]] = []
        self._pending_cells: list[tuple[str, int, dict[str, Any]]] = []
        self._out_loss: list[list[Any]] = []
        self._out_cells: list[list[Any]] = []
        self._seen_metrics: list[str] = []
        self._last_sent = 0.0
        self._timer: threading.Timer | None = None
        self._seq = 0
        self.sends = 0
        self.on_msg(self._on_message)

    # -- taking facts ---------------------------------------------------------------------
    def __call__(self, fact: dict[str, Any]) -> None:
        """Take one fact; `loss` and `health` facts are kept, others ignored."""
        kind = fact.get("fact")
        if kind == "loss":
            with self._lock:
                self._pending_loss.append((int(fact.get("step", len(self._loss))), fact["value"]))
        elif kind == "health":
            numbers = fact.get("numbers") or {}
            with self._lock:
                self._pending_cells.append((str(fact["where"]), int(fact["step"]), dict(numbers)))
        else:
            return
        self._maybe_send()

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
            return
        with self._lock:
            if self._timer is None and (self._pending_loss or self._pending_cells):
                wait = max(0.0, self.interval - (time.monotonic() - self._last_sent))
                self._timer = threading.Timer(wait, self._push)
                self._timer.daemon = True
                self._timer.start()

    def _take_pending(self) -> list[str]:
        """Move what came in into what is kept, and into the outbox; the new metric names."""
        loss, self._pending_loss = self._pending_loss, []
        raw, self._pending_cells = self._pending_cells, []
        new_metrics = []
        for where, step, numbers in raw:
            for k in numbers:
                if k not in self._seen_metrics:
                    self._seen_metrics.append(k)
                    new_metrics.append(k)
            flags = self._flags(numbers)
            kept = self._cells.get((where, step))
            if kept is None:
                self._cells[(where, step)] = [numbers, flags]
            else:
                kept[0].update(numbers)
                kept[1] = sorted(set(kept[1]) | set(flags))
            self._out_cells.append([where, step, jsonable(numbers), flags])
        self._loss.extend(loss)
        self._out_loss.extend([s, jsonable(float(v))] for s, v in loss)
        return new_metrics

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
                "loss": [[s, jsonable(float(v))] for s, v in self._loss],
                "cells": [
                    [where, step, jsonable(numbers), flags]
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
            return list(self._loss) + list(self._pending_loss)

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
