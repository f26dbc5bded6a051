"""The Learning hole: what trains one node where that node runs, and the messages it reads.

A `Learning` stands on both sides of the node it trains: before it (`Enters`) the input becomes
a leaf, after it the output is kept, and `learn(signal, ctx)` turns the dL/d(output) that comes
back in an `Envelope` into dL/d(input), or None. `Split` is split learning; `Greedy`,
`Synthetic` and `ForwardForward` are other answers to the same `learn`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from somatize.node import Node, unwrap
from somatize.torch._values import mapped
from somatize.torch.placement import modules_of, move, place
from somatize.torch.training.params import trainable_in

__all__ = ["Learning", "Split", "Enters", "Envelope", "envelope", "gradient", "OutOfStep"]
__all__ += ["leafed", "grad_of", "pairs", "scaled", "BROUGHT"]

BROUGHT = "learning/"
"""The prefix of what a Learning brought (a head, a guesser) among the weights of the node it
trains, in `Trainer.export`; no state_dict key can start with it (no attribute name has a /)."""


class OutOfStep(ValueError):
    """A gradient arrived for an activation that is not there any more: the two halves of a cut
    are a step apart (it came for a forward already learnt from, or that never ran)."""


class Envelope:
    """A gradient on its way back across an edge (dL/d(the value that crossed), or None for
    nobody owing anything), and whether this step `closing` ends a group of accumulated ones."""

    __slots__ = ("gradient", "closing")

    def __init__(self, gradient: Any, closing: bool = False) -> None:
        self.gradient = gradient
        self.closing = closing

    def __repr__(self) -> str:
        what = "nothing" if self.gradient is None else type(self.gradient).__name__
        return f"Envelope({what}{', closing' if self.closing else ''})"


def envelope(gradient: Any, closing: bool = False) -> Envelope:
    """A gradient in its envelope, which is how one crosses an edge; `closing` says it ends a
    group of accumulated ones, so whoever is accumulating applies what it has."""
    return Envelope(gradient, bool(closing))


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, torch.Tensor):
        return a + (b if b.device == a.device else b.to(a.device))
    if isinstance(a, dict):
        return {k: _add(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, (list, tuple)):
        return type(a)(_add(x, y) for x, y in zip(a, b, strict=False))
    raise TypeError(f"cannot add gradients of type {type(a).__name__}")


def gradient(value: Any, device: str | None = None) -> torch.Tensor | None:
    """What an envelope carries, or the sum of what a map of them carries, moved to `device`;
    None for anything else, and for an envelope carrying nothing. An `Opaque` is taken off."""
    value = unwrap(value)
    if type(value) is Envelope:
        total = value.gradient
    elif isinstance(value, Mapping) and value:
        if any(type(v) is not Envelope for v in value.values()):
            return None
        total = functools.reduce(_add, (v.gradient for v in value.values()), None)
    else:
        return None
    return total if device is None else move(total, device)


def scaled(value: Any, by: float) -> Any:
    """`value` with every tensor in it multiplied by `by` (None stays None); `value` itself
    when `by` is 1."""
    return value if by == 1.0 else mapped(value, lambda t: t * by)


def leafed(value: Any, asking: bool | None = None) -> Any:
    """`value` with every floating tensor in it cut from its history into a fresh leaf (in
    containers as they were), asking for a gradient when the tensor did, or when `asking` says."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_floating_point() or t.is_complex()):
            return t
        return t.detach().requires_grad_(t.requires_grad if asking is None else asking)

    return mapped(value, leaf)


def grad_of(value: Any) -> Any:
    """The gradients the leaves inside `value` got, in the same shape (None where none)."""
    if isinstance(value, torch.Tensor):
        return value.grad if value.requires_grad else None
    if isinstance(value, Mapping):
        grads = {k: grad_of(v) for k, v in value.items()}
        return grads if any(g is not None for g in grads.values()) else None
    if isinstance(value, (list, tuple)):
        grads = [grad_of(v) for v in value]
        return grads if any(g is not None for g in grads) else None
    return None


def pairs(value: Any, grad: Any, outs: list, grads: list) -> None:
    """Collect (tensor, its gradient) wherever both exist and the tensor asks for one."""
    # not nested in backward_from: a recursive closure is a reference cycle that keeps the
    # step's tensors until the garbage collector runs
    if grad is None:
        return
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            outs.append(value)
            grads.append(grad if grad.device == value.device else grad.to(value.device))
    elif isinstance(value, Mapping) and isinstance(grad, Mapping):
        for k, v in value.items():
            pairs(v, grad.get(k), outs, grads)
    elif isinstance(value, (list, tuple)) and isinstance(grad, (list, tuple)):
        for v, g in zip(value, grad, strict=False):
            pairs(v, g, outs, grads)


def backward_from(value: Any, signal: Any) -> None:
    """`torch.autograd.backward` from `value` with `signal` as dL/d(value), wherever both are
    tensors and the value asks for a gradient; nothing when there is no such pair."""
    outs: list = []
    grads: list = []
    pairs(value, signal, outs, grads)
    if outs:
        torch.autograd.backward(outs, grads)


class Learning(Node):
    """What trains one node, on the machine that node runs on.

    A technique writes `learn(signal, ctx)`: handed dL/d(what the node produced), it gives back
    dL/d(what it was given), or None. It reaches the node through `held` (this step's
    activation) and `given` (the leaf its input became), both dropped after each learn. Its
    optimizer is built when first needed, over `training()`, wherever the node ended up.

    `optimizer` is a factory such as `torch.optim.SGD`, called with the parameters and `how`;
    `every` is how many steps go into one update (left out, the Trainer's). A group of its own
    is a mean, as the Trainer's is: its `every` steps move the node as one step on those
    batches joined would. Refused: an optimizer that cannot be called, an `every` that is not
    a positive int.

    Class attributes say what a technique asks of the Trainer: `needs_target` (it is told the
    objective and handed each step's `target`), `wants_signal` (False: it learns from something
    else than dL/d(output), so what the node produced goes on detached and no gradient comes
    back for it) and `moves_at_forward` (True: it runs a backward of its own during the forward,
    which `Trainer(parallel=)` refuses, since DDP averages in the step's backward only).
    """

    needs_target = False
    wants_signal = True
    moves_at_forward = False

    def __init__(
        self, optimizer: Callable[..., Any], *, every: int | None = None, **how: Any
    ) -> None:
        if not callable(optimizer):
            raise TypeError(
                f"{type(self).__name__} takes an optimizer factory such as torch.optim.SGD, "
                f"not {type(optimizer).__name__} {optimizer!r:.60}"
            )
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(
                f"{type(self).__name__}(every={every!r}): every is how many steps go into "
                "one update, a positive int (or None for the Trainer's)"
            )
        self.factory = optimizer
        self.how = dict(how)
        self.declared = every
        self.every = every if every is not None else 1
        self.outer = self.every  # the Trainer's every, which each arriving gradient is divided by
        self.pieces = 1
        self.objective: Any = None
        self.target: Any = None
        self.held: Any = None
        self.given: Any = None
        # the node it trains, where the search for the modules it brought does not look
        self._trains = SimpleNamespace(node=None)
        self._optimizer: Any = None
        self._count = 0
        self._closing = False
        self._enters: Enters | None = None

    # -- where it stands --------------------------------------------------------------------
    @property
    def node(self) -> Any:
        """The node it trains, or None before `of`."""
        return self._trains.node

    def of(self, node: Any) -> Learning:
        """The node it trains. Said when the graph is put together (a Learning trains one)."""
        if self._trains.node is not None and self._trains.node is not node:
            raise ValueError(
                f"this {type(self).__name__} already trains a {type(self.node).__name__}; "
                "a Learning trains one node: give each node its own"
            )
        self._trains.node = node
        return self

    def accumulating(self, every: int | None) -> Learning:
        """How many steps go into one update, unless this one already said (it then wins)."""
        if self.declared is None and every is not None:
            self.every = every
        return self

    def told(self) -> dict[str, Any]:
        """What the Trainer told it, to travel to a worker with it: `every`, `pieces`, the
        Trainer's own every (`outer`) and, for a technique that `needs_target`, the objective."""
        said: dict[str, Any] = {"every": self.every, "pieces": self.pieces, "outer": self.outer}
        if self.needs_target:
            said["objective"] = self.objective
        return said

    def tell(
        self, *, every: int, pieces: int = 1, objective: Any = None, outer: int | None = None
    ) -> Learning:
        """Take what the Trainer told it (`told()` on the other side); `outer`, the Trainer's
        every, is `every` unless said."""
        self.every = every
        self.outer = every if outer is None else outer
        self.pieces = pieces
        if objective is not None:
            self.objective = objective
        return self

    def beside(self) -> tuple[Enters, Learning]:
        """Its two positions in a graph: the one that leafs the input, and itself after."""
        if self._enters is None:
            self._enters = Enters(self)
        return self._enters, self

    def training(self) -> list[torch.nn.Parameter]:
        """Which parameters it updates: the node's, and whatever else a technique brought
        with it (a head, a guesser: the modules it holds as attributes)."""
        if self.node is None:
            raise ValueError(
                f"this {type(self).__name__} trains no node yet: it is given one by "
                "Trainer(trains={node_id: ...})"
            )
        return trainable_in([*modules_of(self.node), *modules_of(self)])

    def receiving(self, state: Mapping[str, Any]) -> dict[str, torch.nn.Module]:
        """The parts it lacks to take `state` (the keys of what it brought), by attribute name:
        what a technique builds lazily, built here at the shapes given but not set on (a load
        sets them when it commits: a refused load leaves nothing built). Also called under
        `torch.device("meta")`, only to name their keys: build them, and fill in nothing.
        Nothing by default."""
        return {}

    @property
    def optimizer(self) -> Any:
        """Its optimizer, built the first time it is asked for, over `training()` wherever it
        ended up. A node with nothing to train is refused here."""
        if self._optimizer is None:
            params = self.training()
            if not params:
                raise ValueError(
                    f"{type(self).__name__} trains a {type(self.node).__name__} that holds "
                    "no parameter asking for a gradient: take it out of trains="
                )
            self._optimizer = self.factory(params, **self.how)
        return self._optimizer

    # -- the group ----------------------------------------------------------------------------
    @property
    def group(self) -> int:
        """How many pieces go into one update: `every` steps of `pieces` pieces each. A
        technique with a loss of its own divides it by this, as the Trainer divides its own."""
        return self.every * self.pieces

    @property
    def share(self) -> float:
        """What an arriving gradient, divided by the Trainer's `every`, is multiplied by to count
        in a group of this technique's own `every` (1.0 when the two agree); what it gives back
        upstream is divided by it again, to count in the Trainer's group."""
        return self.outer / self.every

    def opens(self) -> bool:
        """Whether this step starts a group, which is where gradients are cleared."""
        return self._count == 0

    def due(self) -> bool:
        """Whether this step will close its group, by count: what a technique that acts before
        the envelope arrives reads (the Trainer's `update()` closes a group early)."""
        return self._count + 1 >= self.group

    def closes(self) -> bool:
        """Whether this step ends a group, where the optimizer moves: by the envelope with the
        Trainer's `every`, counted with its own."""
        if self._closing and self.held is None:
            return True  # the Trainer's update(): apply what there is
        if self.declared is None:
            return self._closing
        return self.due()

    def stepped(self, backward: Callable[[], Any]) -> Any:
        """One step of the group, as every technique takes it: gradients cleared where the
        group opens, `backward()`, the optimizer stepped where it closes; answers `done()`."""
        optimizer = self.optimizer
        if self.opens():
            optimizer.zero_grad()
        backward()
        if self.closes():
            optimizer.step()
        return self.done()

    def minimising(self, loss: Callable[[], torch.Tensor]) -> None:
        """`stepped` on a loss of the technique's own: `loss() / group` backward, `loss()`
        called only when an activation is held (not for the Trainer's `update()`)."""

        def backward() -> None:
            if self.held is not None:
                (loss() / self.group).backward()

        self.stepped(backward)

    # -- the two positions --------------------------------------------------------------------
    def entering(self, value: Any, ctx: Any) -> Any:
        """The input as a leaf, remembered, which is what makes dL/d(input) exist. The first
        time, what the technique brought goes to the node's device."""
        if self._optimizer is None and ctx is not None and ctx.device is not None:
            place(self, ctx.device)
        self.given = leafed(value)
        return self.given

    def forward(self, value: Any, ctx: Any) -> Any:
        """After the node: an ordinary value is the activation to keep (handed on, detached for
        a technique that `wants_signal` False), an envelope is the gradient to learn from (and
        an envelope for the input comes back). An empty envelope with nothing held or
        accumulated (the Trainer's `update()` reaching a group already applied) is not learnt
        from."""
        if type(value) is Envelope:
            self._closing = value.closing
            signal = gradient(value, ctx.device if ctx is not None else None)
            if signal is None and self.held is None and self._count == 0:
                self.done()  # nothing accumulated, nothing owed
                return Envelope(None, value.closing)
            return Envelope(self.learn(signal, ctx), value.closing)
        self.held = value
        self.kept(ctx)
        return value if self.wants_signal else leafed(value, False)

    def kept(self, ctx: Any) -> None:
        """What a technique does the moment the node's output is kept, before any gradient for
        it can arrive. Nothing, unless it does not wait for one (`Synthetic`)."""

    def waiting(self) -> Any:
        """The activation this step left, or `OutOfStep` if there is none."""
        if self.held is None:
            raise OutOfStep(
                f"a gradient arrived for the {type(self.node).__name__} that "
                f"{type(self).__name__} trains, and no activation is waiting for it: the two "
                "halves of the cut are a step apart (learn once per forward)"
            )
        return self.held

    def done(self) -> Any:
        """Lets go of this step's activation and gives back what the node was given."""
        given = self.given
        if self.held is not None or self._closing:
            self._count = 0 if self.closes() else self._count + 1
        self.held = self.given = self.target = None
        self._closing = False
        return given

    def learn(self, signal: torch.Tensor | None, ctx: Any) -> Any:
        """The hole a technique fills: what to do with dL/d(what the node produced) (`signal`, None
        when nobody owes it anything this step), and what to give back."""
        raise NotImplementedError(
            f"{type(self).__name__} is a Learning and must say learn(signal, ctx)"
        )

    def __repr__(self) -> str:
        name = getattr(self.factory, "__name__", type(self.factory).__name__)
        how = "".join(f", {k}={v!r}" for k, v in self.how.items())
        every = f", every={self.declared}" if self.declared is not None else ""
        return f"{type(self).__name__}({name}{every}{how})"


class Enters(Node):
    """The position before a trained node: its input becomes a leaf there, and an envelope
    coming back through it is handed on as it is."""

    def __init__(self, learning: Learning) -> None:
        self.learning = learning

    def forward(self, value: Any, ctx: Any) -> Any:
        """Leaf the input (remembered by the Learning), or hand an envelope on."""
        if type(value) is Envelope:
            return value
        return self.learning.entering(value, ctx)


class Split(Learning):
    """Split learning: carry the chain rule on from the gradient of the seam, step, and hand
    back the gradient of the input. In one process it gives the numbers backpropagation gives."""

    def learn(self, signal: torch.Tensor | None, ctx: Any) -> Any:
        """Backward through the node from `signal`, step when the group closes, and give back
        dL/d(what the node was given). With an `every` of its own the signal counts in its
        group by `share`, and what goes back is in the Trainer's group again."""
        held = self.waiting() if signal is not None else None
        share = self.share
        signal = scaled(signal, share)
        return scaled(grad_of(self.stepped(lambda: backward_from(held, signal))), 1 / share)
