"""What goes wrong across a wire, as exceptions a caller can catch by type."""

from __future__ import annotations

from typing import Any

__all__ = ["Unknown", "WorkerLost", "RemoteError", "StateLost"]


class Unknown(LookupError):
    """The worker does not hold what a request names (a node, a slice, a stage part): it was
    restarted, its session expired, or it was never sent."""


def not_held(what: str) -> Unknown:
    """The `Unknown` of a worker that does not hold `what` ("node 'enc'", say)."""
    return Unknown(
        f"this worker does not hold {what}: it was restarted, the session expired, or it was "
        "never sent"
    )


class WorkerLost(ConnectionError):
    """The worker went away (or never answered) while a request was waiting for it."""


class RemoteError(RuntimeError):
    """A failure on a worker whose exception type is not rebuilt here; says what it was."""


class StateLost(RuntimeError):
    """A worker lost what nodes learnt there since their weights were last read back.

    Raised instead of training on from stale weights: the worker was restarted (or its
    session expired) after the nodes in `nodes` had been trained there. `exported` holds the
    weights this client last read back from the worker or sent it (`{node id: {key:
    tensor}}`); `Trainer.load(error.exported)` resumes from them, `Trainer.load(weights)` from
    weights you kept.
    """

    def __init__(self, message: str, nodes: list[str], exported: dict[str, Any]) -> None:
        super().__init__(message)
        self.nodes = nodes
        self.exported = exported
