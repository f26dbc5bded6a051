"""What a worker asks of torch through `somatize._hooks`: a node's weights, loading them, and
the requests of a trainer's stage (`stage.forward`, `stage.backward`)."""

from __future__ import annotations

from typing import Any

import torch

from somatize import _hooks


def state_of(node: Any) -> dict[str, torch.Tensor]:
    """The node's weights as `{key: tensor}`, detached copies on the CPU. A Learning's are
    what it brought (a head, a guesser): the node it trains travels on its own."""
    from somatize.torch.training.learning import Learning
    from somatize.torch.training.params import state_of as keyed

    state = keyed(node)
    if isinstance(node, Learning):
        state = {k: v for k, v in state.items() if not k.startswith("node.")}
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def load_state(node: Any, state: dict[str, Any]) -> None:
    """Copy `state` (as `state_of` gives it) into the node, refusing a mismatch whole."""
    from somatize.torch.training.learning import Learning
    from somatize.torch.training.params import state_of as keyed

    if isinstance(node, Learning):
        node.receiving(state)  # what it builds lazily (a guesser) is built at the shapes sent
    own = keyed(node)
    if set(own) != set(state):
        raise ValueError(
            f"{type(node).__name__}: the weights sent have keys {sorted(state)}, the node here "
            f"{sorted(own)}; nothing was loaded"
        )
    for k, v in state.items():
        if tuple(own[k].shape) != tuple(v.shape):
            raise ValueError(
                f"{type(node).__name__}: {k} is {tuple(own[k].shape)} here and "
                f"{tuple(v.shape)} in the weights sent; nothing was loaded"
            )
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def serve(server: Any, session: str, nodes: dict[str, Any], op: str, message: dict) -> Any:
    """A trainer's stage on this worker (`somatize.torch.training.remote`)."""
    if not op.startswith("stage."):
        raise ValueError(f"unknown request {op!r}")
    from somatize.torch.training.remote import serve_stage

    return serve_stage(server, session, nodes, op, message)


_hooks.register(state_of=state_of, load_state=load_state, serve=serve)
