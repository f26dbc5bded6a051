"""Synthetic gradients: a node updated with a guess of its gradient, the guesser taught by the
true one when it arrives (Jaderberg et al., "Decoupled neural interfaces", 2017)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from somatize.torch.placement import modules_of
from somatize.torch.training.learning import Learning, grad_of, scaled
from somatize.torch.training.params import holds, trainable_in

__all__ = ["Synthetic", "Guesser"]


class Guesser(nn.Linear):
    """dL/d(output) guessed from the output: one linear map over its features (all but the
    first dimension, flattened), zero at first so that the first guesses move nothing."""

    def __init__(self, features: int, *, dtype: Any = None, device: Any = None) -> None:
        super().__init__(features, features, dtype=dtype, device=device)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        """The guessed gradient, in the shape of `output`."""
        return super().forward(output.reshape(len(output), -1)).view_as(output)


def _step_only(optimizer: Any, params: Iterable[torch.Tensor]) -> None:
    """`optimizer.step()` for these parameters only: the others' gradients are set aside (a None
    grad is one torch's optimizers skip) and put back."""
    keep = {id(p) for p in params}
    aside = []
    for p in holds(optimizer):
        if id(p) not in keep and p.grad is not None:
            aside.append((p, p.grad))
            p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in aside:
            p.grad = grad


class Synthetic(Learning):
    """Synthetic gradients (decoupled neural interfaces, Jaderberg et al. 2017).

    A `Guesser` (built from the shape of the node's first output, zero at first) predicts
    dL/d(output) at forward time, and right then the node is updated with the guess: backward
    with it, and a step when the group closes; the gradient of the input under the guess goes
    upstream. When the true gradient arrives the guesser learns from it, its loss `½‖guess −
    true‖²` over the batch, stepped when the group closes. Node and guesser share one optimizer,
    each stepped at its own moment. With an `every` of its own the true gradient is taught in
    that group's terms (`Learning.share`), and what goes upstream in the Trainer's. On a
    worker the node's update is made while the forward runs there; the true gradient, when it
    comes, teaches only the guesser. The guesser is exported with the node under
    `learning/guesser.…`, and loading those builds it.

    Refused: a node that produces something other than one floating tensor with a batch
    dimension (there is no shape to guess a gradient of).
    """

    moves_at_forward = True  # the node steps on the guess while the forward runs
    guesser: Guesser | None = None  # built at the first output, or by a load
    _guess: torch.Tensor | None = None

    def receiving(self, state: Mapping[str, Any]) -> dict[str, nn.Module]:
        """A guesser at the shape of the `guesser.weight` given, to be set on when the load
        commits, if none is built yet."""
        weight = state.get("guesser.weight")
        if self.guesser is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return {"guesser": Guesser(weight.shape[1], dtype=weight.dtype)}
        return {}

    def kept(self, ctx: Any) -> None:
        """The node's update, with the guess, the moment its output is kept."""
        out = self.held
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 1:
            where = ctx.id.split("/")[0] if ctx is not None else "the node"
            raise TypeError(
                f"Synthetic guesses the gradient of one floating tensor, and node {where!r} "
                f"produced {type(out).__name__}"
                + (f" {tuple(out.shape)} of {out.dtype}" if isinstance(out, torch.Tensor) else "")
                + ": train it with Split, or make it produce one tensor"
            )
        if self.guesser is None:
            features = out[0].numel() if out.dim() > 1 else 1
            self.guesser = Guesser(features, dtype=out.dtype, device=out.device)
        elif self._optimizer is None:
            self.guesser.to(device=out.device)  # built by a load, before any output
        optimizer = self.optimizer
        own = trainable_in(modules_of(self.node))
        if self.opens():
            for p in own:
                p.grad = None
        guess = self.guesser(out.detach())
        if out.requires_grad:
            torch.autograd.backward([out], [guess.detach()])
        self._guess = guess
        if self.due():
            _step_only(optimizer, own)

    def learn(self, signal: torch.Tensor | None, ctx: Any) -> Any:
        """The guesser learns from the true gradient `signal`; gives back dL/d(input) under
        the guess, worked out when the output was kept."""
        optimizer = self.optimizer
        if self.held is None:
            if signal is not None:
                self.waiting()  # OutOfStep
            optimizer.step()  # the Trainer's update(): what the open group holds, both halves
            self.done()
            return None
        guesser = list(self.guesser.parameters())
        if self.opens():
            for p in guesser:
                p.grad = None
        guess, self._guess = self._guess, None
        share = self.share  # the true gradient, and so the guess, in its own group's terms
        if signal is not None and guess is not None:
            true = signal.to(guess.dtype) * share
            # the gradient of ½‖guess − true‖² with respect to the guess is guess − true
            torch.autograd.backward([guess], [guess.detach() - true])
        if self.closes():
            _step_only(optimizer, guesser)
        return scaled(grad_of(self.done()), 1 / share)
