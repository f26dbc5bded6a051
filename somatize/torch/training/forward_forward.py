"""Forward-forward: a node that learns from the goodness of what it produces, positive data
against negatives it makes (Hinton, "The forward-forward algorithm", 2022)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

from somatize.node import unwrap
from somatize.torch.training.learning import Learning

__all__ = ["ForwardForward", "negatives", "partners", "goodness"]


def partners(target: torch.Tensor) -> torch.Tensor:
    """For each row of a batch, the nearest row after it (going round) whose target differs;
    the next row where every row has the same target. That row is the first one after it
    where the target changes from the row before, which is what is looked up."""
    rows = target.shape[0]
    flat = target.reshape(rows, -1)
    after = torch.arange(1, rows + 1, device=target.device)
    changes = torch.nonzero((flat != flat.roll(1, 0)).any(dim=1)).flatten()
    if not changes.numel():
        return after % rows
    ahead = torch.cat([changes, changes + rows])
    return ahead[torch.searchsorted(ahead, after)] % rows


def negatives(given: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Negative data from a batch: each row blended half and half with its partner, the
    nearest row after it whose target differs (`partners`). A hybrid of two classes, as
    Hinton's unsupervised negatives are hybrids of two images, made the same way at any depth:
    it needs no pixels and no room in the input for a label. Deterministic: the same batch gives
    the same negatives in every process."""
    return torch.lerp(given, given[partners(target)], 0.5)


def goodness(output: torch.Tensor) -> torch.Tensor:
    """The goodness of each row: the mean of the squares of its activities."""
    return output.reshape(len(output), -1).square().mean(dim=1)


class ForwardForward(Learning):
    """Hinton's forward-forward (2022): the node learns from a goodness of its own output,
    high on positive data and low on negatives it makes, and hands no gradient back upstream.

    Goodness is the mean square of a row's activities (`goodness`); the loss is
    `softplus(threshold − goodness(positive))` and `softplus(goodness(negative) − threshold)`,
    averaged over both and divided by `every * micro` as the Trainer divides its own. Positive
    data is what the node was given; the negatives are made from it (`negatives`), so they work
    for a node in the middle, which never sees the pixels nor the label. The target reaches it as
    it reaches `Greedy`. The node is run on the negatives through its own class's `forward`
    (hooks on the node itself, such as an audit's, do not hear that run). No randomness: in
    process and on a worker the same batch gives the same negatives.

    What the node produces is handed on detached: a head above it (the readout) trains by
    backpropagation while this node trains by itself, and a node before it gets no gradient
    (`NoGradient` for one held by the Trainer's optimizer).

    Refused: a `threshold` that is not a positive number; a node given anything but one
    floating tensor of at least two rows, or a target without a row for each; a node that
    produces anything but one floating tensor with a row per example.
    """

    needs_target = True
    wants_signal = False

    def __init__(
        self,
        optimizer: Callable[..., Any],
        *,
        threshold: float = 2.0,
        every: int | None = None,
        **how: Any,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
            raise ValueError(
                f"ForwardForward(threshold={threshold!r}): the goodness a positive row should "
                "pass and a negative one stay under, a positive number (2.0 by default)"
            )
        super().__init__(optimizer, every=every, **how)
        self.threshold = float(threshold)

    def learn(self, signal: torch.Tensor | None, ctx: Any) -> Any:
        """Goodness on positives against negatives, backward, step when the group closes;
        gives back nothing. `signal` is not read: what the node produced went on detached."""
        self.minimising(lambda: self._loss(ctx))
        return None

    def _loss(self, ctx: Any) -> torch.Tensor:
        given, target = self.given, self.target
        where = ctx.id.split("/")[0] if ctx is not None else "the node"
        rows = given.shape[0] if isinstance(given, torch.Tensor) and given.dim() else 0
        if rows < 2 or not given.is_floating_point():
            shape = tuple(given.shape) if isinstance(given, torch.Tensor) else None
            raise TypeError(
                f"ForwardForward makes its negatives from the batch node {where!r} is given, "
                f"one floating tensor of at least two rows; it was given "
                f"{type(given).__name__}{'' if shape is None else f' {shape}'}"
            )
        if not isinstance(target, torch.Tensor) or target.dim() < 1 or target.shape[0] != rows:
            raise TypeError(
                f"ForwardForward pairs each row of the batch node {where!r} is given with a row "
                f"of another target, and the target is {type(target).__name__}"
                + (f" {tuple(target.shape)}" if isinstance(target, torch.Tensor) else "")
                + f" for {rows} rows: give a tensor with one target per row"
            )
        held = self.held
        if not isinstance(held, torch.Tensor) or held.dim() < 1 or not held.is_floating_point():
            what = f" {tuple(held.shape)} of {held.dtype}" if isinstance(held, torch.Tensor) else ""
            raise TypeError(
                f"ForwardForward scores the goodness of what node {where!r} produces, one "
                f"floating tensor with a row per example; it produced {type(held).__name__}"
                f"{what}: train it with Greedy or Split, or make it produce one tensor"
            )
        node = self.node
        negative = unwrap(type(node).forward(node, negatives(given.detach(), target), ctx))
        high = functional.softplus(self.threshold - goodness(held))
        low = functional.softplus(goodness(negative) - self.threshold)
        return torch.cat([high, low]).mean()
