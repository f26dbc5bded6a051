"""`Result`: what `Trainer.fit` leaves behind, step by step and epoch by epoch."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Result"]


@dataclass(repr=False)
class Result:
    """What a training run leaves behind, filled in as the fit goes:

    - `history`: the loss of each step (the loss curve: `plt.plot(result.history)`);
    - `seconds`: how long each step took, wall time, one per loss (a step's time is the
      forward, the backward and, where a group closes, the update);
    - `epochs`: the mean of each epoch's losses, one per epoch walked whole (what a
      per-epoch scheduler such as `ReduceLROnPlateau` steps on).

    It prints as one line (`Result(40 steps, loss 2.31 → 0.412, 1.2 s)`), so `t.fit(...)`
    ending a cell does not print every loss."""

    history: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    epochs: list[float] = field(default_factory=list)

    @property
    def loss(self) -> float | None:
        """The last loss, or None if not a single step was taken."""
        return self.history[-1] if self.history else None

    def __repr__(self) -> str:
        n = len(self.history)
        if not n:
            return "Result(0 steps)"
        steps = "1 step" if n == 1 else f"{n} steps"
        took = f", {sum(self.seconds):.3g} s" if self.seconds else ""
        return f"Result({steps}, loss {self.history[0]:.3g} → {self.history[-1]:.3g}{took})"
