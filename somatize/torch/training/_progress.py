"""The progress bar `Trainer.fit` shows a person watching: tqdm's, on stderr or as a widget in
a notebook, where it becomes one line saying what the fit did when the fit ends (a widget's
saved picture would be its first state, "0%")."""

from __future__ import annotations

import sys
import time
from typing import Any


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel, where a widget can be shown."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def person_watching() -> bool:
    """Whether a person is watching: a notebook kernel, or a terminal on stderr."""
    if in_notebook():
        return True
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def live_shown(watching: list) -> Any:
    """In a notebook, a `LiveAudit` shown for an audited run, unless one is among `watching`
    already; None otherwise."""
    if not in_notebook():
        return None
    from IPython.display import display

    from somatize.figures import LiveAudit

    if any(isinstance(getattr(w, "audit", w), LiveAudit) for w in watching):
        return None
    live = LiveAudit()
    display(live)
    return live


def summary(history: list[float], total: int | None, seconds: float) -> str:
    """What a fit did, in one line: its steps (of how many, if it stopped short), the first
    and the last loss, and how long it took."""
    n = len(history)
    if n == 0:
        return "training: no steps"
    steps = f"{n} of {total} steps (stopped)" if total is not None and n < total else f"{n} steps"
    return f"training: {steps}, loss {history[0]:.4g} → {history[-1]:.4g}, {seconds:.1f} s"


class Progress:
    """A bar over the steps of `epochs` walks of `data` for a person watching, a widget in a
    notebook: `step(loss)` after each, `close(history)` at the end, whatever happened."""

    def __init__(self, data: Any, epochs: int) -> None:
        try:
            total: int | None = epochs * len(data)
        except TypeError:  # no length: a generator, a DataLoader over an IterableDataset
            total = None
        self.total = total
        self.began = time.perf_counter()
        self.shown: Any = None  # the notebook output the bar is in
        if in_notebook():
            try:
                from IPython.display import display
                from tqdm.notebook import tqdm as widget

                self.bar = widget(total=total, desc="training", unit="step", display=False)
                self.shown = display(self.bar.container, display_id=True)
                return
            except ImportError:  # no ipywidgets: the text bar, as tqdm.auto would fall back
                pass
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="training", unit="step")

    def step(self, loss: float) -> None:
        """One step done, with its loss."""
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

    def close(self, history: list[float]) -> None:
        """The bar closed; in a notebook its output becomes the line `summary` makes."""
        self.bar.close()
        if self.shown is not None:
            line = summary(history, self.total, time.perf_counter() - self.began)
            self.shown.update({"text/plain": line}, raw=True)
