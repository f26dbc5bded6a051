"""The live audit: a watcher that draws a run's health while it trains.

    audit = LiveAudit()
    audit                      # show it
    Trainer(g, objective=..., auditing=True, watching=audit).fit(...)

The training thread only queues the facts it is handed; a sender thread, at most every
`interval` seconds, puts them into columns (`_history`), judges them and sends the page what
is new: every metric as binary float64 beside a JSON message, so the page redraws another
metric at once, even while the kernel is busy with the fit.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Any

import anywidget
import traitlets

from somatize import health
from somatize.figures._audit_face import picture
from somatize.figures._history import History, Run, message, record, step_of
from somatize.figures._page import STATIC, Face, image
from somatize.figures._svg import counted
from somatize.health.verdict import as_float

__all__ = ["LiveAudit"]


def _explanations() -> dict[str, dict[str, str]]:
    """What the page says of every metric and flag (`somatize.health.METRICS`, `about`) and
    each flag's family, which colours its marks: {"metrics": ..., "flags": ..., "families": ...}.
    A flag with a count is said of one."""
    said = {n: n for n in health.__all__ if isinstance(getattr(health, n), health.Flag)}
    said |= {n: f"{n}(1)" for n in ("DEAD_CHANNELS", "IGNORED_CHANNELS")}
    return {
        "metrics": dict(health.METRICS),
        "flags": {n: health.about(flag) for n, flag in said.items()},
        "families": {n: health.family(flag) for n, flag in said.items()},
    }


# the metric shown first: the update ratio ‖Δθ‖/‖θ‖ has no units, so one colour scale fits
# every layer, and it says at once whether a layer learns (too small: stalled; too large:
# overstepping); a gradient norm spans decades between layers and its scale hides most rows
PREFERRED = ("update_ratio", "grad_norm")
# the share of the time the sender thread may spend judging while facts come (it shares the
# interpreter with the training); what it has not reached is judged when the cell ends
JUDGING = 0.03


class LiveAudit(Face, anywidget.AnyWidget):
    """A live picture of a run's health: the loss above (real axes, a log scale and
    smoothing to choose), a heatmap below whose rows are the watched places and columns the
    steps, one metric per cell, chosen from a menu (every metric is explained in the menu and
    the tooltip); a step at which `somatize.health` flags its place (by the rule `diagnose`
    uses, so a place's last step says what `diagnose` says of the run) gets a mark under its
    cell in the colour of the flag's family, and a place that raised flags says which beside
    its name. Everything drawn is in the legend. `flags=False` marks nothing.

    Call it with facts (pass it as `watching=`); it keeps `loss` and `health` facts and
    ignores the rest. `run(name)` is a watcher for a second run drawn beside the first (its
    places as rows under the same names, its loss as a second curve): `watching=audit.run(
    "sgd")`. A fact is refused (ValueError, nothing of it kept) when it names no node or its
    step is not an integer. What is new goes to the page at most every `interval` seconds
    while facts come, and all of it when the cell ends; `frame()` and `loss` read what it
    holds at any time. The default metric is `update_ratio` where it is measured, else
    `grad_norm` (see PREFERRED for why); `metric=` chooses another."""

    _bundle = "audit"
    _esm = STATIC / "audit.js"
    _css = STATIC / "audit.css"
    _saved = ("title", "metric", "metrics", "explain", "log_loss", "smoothing", "record")

    title = traitlets.Unicode("live audit").tag(sync=True)
    metric = traitlets.Unicode("").tag(sync=True)
    metrics = traitlets.List(traitlets.Unicode()).tag(sync=True)
    explain = traitlets.Dict().tag(sync=True)
    log_loss = traitlets.Bool(False).tag(sync=True)
    smoothing = traitlets.Float(0.6).tag(sync=True)
    record = traitlets.Dict().tag(sync=True)

    def __init__(
        self,
        *,
        metric: str = "",
        title: str = "live audit",
        interval: float = 0.25,
        flags: bool = True,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval= is seconds between sends and must be > 0, not {interval}")
        super().__init__(metric=metric, title=title, explain=_explanations())
        self.interval = float(interval)
        self._auto = ""  # the metric this audit chose itself
        self._history = History(flags)
        self._queue: list[tuple] = []
        self._intake = threading.Lock()  # the queue: held for an append
        self._lock = threading.RLock()  # the columns and what was sent
        self._sent: dict = {}
        self._sender: threading.Thread | None = None
        self._recorded = -1
        self.sends = 0  # messages sent: each one's `seq`
        self.on_msg(self._on_message)

    def __call__(self, fact: dict[str, Any]) -> None:
        """Take one fact (`loss` and `health`; others are ignored): checked here, in the
        caller's thread, and queued."""
        self._take(fact, "")

    def run(self, name: str) -> Any:
        """A watcher whose facts are drawn as the run `name`, beside this audit's others."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a run is named by a non-empty string, not {name!r}")
        watcher = functools.partial(self._take, run=name)
        watcher.audit = self  # type: ignore[attr-defined]  # a Trainer sees a LiveAudit watching
        return watcher

    def _take(self, fact: dict[str, Any], run: str) -> None:
        kind = fact.get("fact") if isinstance(fact, dict) else None
        if kind not in ("health", "loss"):
            return
        # checked here, so a bad fact is refused in the caller's thread; read later
        if kind == "health" and type(fact.get("node")) is not str:
            health.where_of(fact)
        if kind == "health" or fact.get("step") is not None:
            step_of(fact)
        item = (run, fact.copy())  # the caller may reuse its dict
        with self._intake:
            self._queue.append(item)
            idle = self._sender is None
            if idle:
                self._sender = threading.Thread(
                    target=self._rounds, name="somatize-live-audit", daemon=True
                )
        if idle:
            self._sender.start()

    def _drain(self, judge: float | None = 0.0) -> bool:
        """Put what is queued into the columns (the lock held) and judge what it can: all of
        it with `judge=None`, else for `judge` seconds; whether anything changed."""
        with self._intake:
            queue, self._queue = self._queue, []
        history = self._history
        for run, fact in queue:
            if fact["fact"] == "health":
                history.health(run, fact)
            else:
                history.loss(run, fact)
        if queue:
            self._choose()
        judged = history.judge(None if judge is None else time.perf_counter() + judge)
        return bool(queue) or judged

    def _choose(self) -> None:
        seen = list(self._history.metrics)
        self.metrics = seen  # an equal list: traitlets notifies nobody, nothing is sent
        if self.metric == self._auto:  # nobody chose another: still ours to choose
            best = next((m for m in PREFERRED if m in seen), seen[0] if seen else "")
            self.metric = self._auto = best

    def _rounds(self) -> None:
        quiet = 0
        while True:
            time.sleep(self.interval)
            with self._lock:  # the verdict gets a few percent of the time, the rest later
                fresh = self._drain(judge=self.interval * JUDGING)
                if fresh:
                    self._push()
            quiet = 0 if fresh else quiet + 1
            if quiet >= 2:
                with self._intake:
                    if not self._queue:
                        self._sender = None
                        return

    def _push(self, everything: bool = False) -> None:
        """Send what is new (or everything) as one message, its numbers as binary."""
        buffers: list = []
        body = message(self._history, self._sent, buffers, everything)
        if not body["runs"]:
            return
        self.sends += 1
        self.send({"kind": "reset" if everything else "append", "seq": self.sends, **body}, buffers)

    def sync(self) -> None:
        """Judge and send everything pending now, whatever the interval."""
        with self._lock:
            self._drain(judge=None)
            self._push()

    def settle(self) -> None:
        """Send what is pending and keep a copy of everything in `record` (what a page with
        no kernel draws): done at the end of every cell that showed this audit."""
        with self._lock:  # re-entrant: sync() takes it too
            self.sync()
            if self._recorded != self._history.version:
                self.record = record(self._history)
                self._recorded = self._history.version

    def _on_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("kind") == "hello":
            with self._lock:  # a page opened late (or reloaded) is sent everything
                self._drain()
                self._push(everything=True)

    @property
    def loss(self) -> list[tuple[int, float]]:
        """The loss facts seen (of the first run), as (step, value), including any queued."""
        with self._lock:
            self._drain()
            run = next(iter(self._history.runs.values()), Run())  # none yet: an empty one
            return list(zip(run.loss_steps, run.loss_values, strict=True))

    def frame(self) -> Any:
        """The health facts seen as a pandas DataFrame: one row per (where, step), a column
        per metric (NaN where a fact did not carry it; bools and ints as they were given), and
        `flags`, its place's flags as of that step. With more than one run, a `run` column
        first."""
        import pandas as pd

        with self._lock:
            self._drain(judge=None)
            parts = []
            many = len(self._history.runs) > 1
            for name, run in self._history.runs.items():
                for where, place in run.places.items():
                    data: dict[str, Any] = {"run": [name] * len(place.steps)} if many else {}
                    data["where"] = [where] * len(place.steps)
                    data["step"] = list(place.steps)
                    for metric, column in place.columns.items():
                        values = [math.nan if v is None else v for v in column]
                        # an int a float cannot hold (10**400) is kept as given: pandas 3 makes
                        # such a list objects by itself, pandas 2 (Python 3.10's) raises
                        past = any(isinstance(v, int) and math.isinf(as_float(v)) for v in values)
                        data[metric] = pd.Series(values, dtype=object) if past else values
                    data["flags"] = [list(f) for f in place.flags]
                    parts.append(pd.DataFrame(data))
        if not parts:
            return pd.DataFrame(columns=["where", "step", "flags"])
        frame = pd.concat(parts, ignore_index=True)
        return frame[[c for c in frame.columns if c != "flags"] + ["flags"]]

    def svg(self) -> str:
        """The audit as SVG text: what it has seen of the chosen metric."""
        with self._lock:
            self._drain(judge=None)
            return picture(
                self._history, self.metric, self.title, log=self.log_loss, smoothing=self.smoothing
            )

    def plain(self) -> str:
        """One line saying what it is; the same from the start to the end of a fit (a saved
        notebook's text must not depend on when it was last brought up to date)."""
        return f"{self.title}: a live audit of the watched places' health, step by step"

    def face(self) -> str:
        """The picture as an image, named by what it holds (places, steps, runs)."""
        with self._lock:
            self._drain(judge=0)
            runs = self._history.runs.values()
            places = len(self._history.places())
            steps = {s for r in runs for p in r.places.values() for s in p.steps}
            steps = steps or {s for r in runs for s in r.loss_steps}  # losses only: a loss figure
            more = f", {len(runs)} runs" if len(runs) > 1 else ""
        held = counted(places, "place") if places else "loss only"
        return image(self.svg(), f"{self.title}: {held}, {counted(len(steps), 'step')}{more}")
