"""Greedy: a node trained by its own copy of the run's objective, through a head of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from somatize.torch.training.learning import Learning

__all__ = ["Greedy"]


class Greedy(Learning):
    """Local learning: the node is trained by its own copy of the run's objective, through
    `head`, and hands no gradient back upstream.

    `head` is a small module from what the node produces to what the objective takes (for a
    hidden layer of 128 features, `nn.Linear(128, 10)`). Each step the node's loss is
    `objective(head(output), target)`, with the Trainer's objective and the batch's target (of
    each `micro` piece), divided by `every * micro` as the Trainer divides its own; the node and
    the head step under one optimizer (`training()` holds both). The head goes to the node's
    device and is exported and loaded with it under `learning/head.…`. On a worker the objective
    travels by name (a function of torch, such as `torch.nn.functional.cross_entropy`) and the
    head as code, to a worker started with `--accept-code`.

    What the node produces goes on detached: a node after it learns from it without sending a
    gradient back, and a node before it gets none (`NoGradient` for one held by the Trainer's
    optimizer: train it with its own `Greedy`, or freeze it).

    Refused: a `head` that is not an `nn.Module`; learning without an objective (a Greedy used
    without a Trainer, before `tell(objective=...)`).
    """

    needs_target = True
    wants_signal = False

    def __init__(
        self,
        optimizer: Callable[..., Any],
        *,
        head: nn.Module,
        every: int | None = None,
        **how: Any,
    ) -> None:
        if not isinstance(head, nn.Module):
            raise TypeError(
                f"Greedy(head=...) takes the nn.Module from what the node produces to what the "
                f"objective takes (e.g. nn.Linear(128, 10)), not {type(head).__name__}"
            )
        super().__init__(optimizer, every=every, **how)
        self.head = head

    def learn(self, signal: torch.Tensor | None, ctx: Any) -> Any:
        """The node's own loss through the head, backward, step when the group closes; gives
        back nothing (no gradient upstream). `signal` is not read: the output went on detached."""
        if self.objective is None:
            raise ValueError(
                "Greedy learns from the run's objective, and has not been told one: use it "
                "through Trainer(trains={node: Greedy(...)}), or tell(objective=...) first"
            )
        self.minimising(lambda: self.objective(self.head(self.held), self.target))
        return None
