"""A trainer's stage on a worker: the remote `Transport` of `somatize.torch.training.stages`.

`Remote(broker, host)` answers the same two calls as `somatize.stages.Local`: `forward(part,
inputs)` and `backward(part, envelopes)`. The first forward sends the part (its nodes, their
settings, its edges to outside and, around a trained node, its `Learning`) and the worker
rebuilds it as a `Part` of its own; from then on a forward sends values and a backward sends
envelopes, one round trip each. Between the two the worker keeps what the part holds (the
activation, with its autograd graph), which is why a worker restarted in between answers
`OutOfStep` and not a gradient for something it never computed.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import fields
from typing import Any

from somatize import _hooks
from somatize.remote.server import Unknown

__all__ = ["Remote", "serve_stage"]

_pkeys = itertools.count(1)


class Remote:
    """Runs a trainer's part on the worker of `host`, through `broker`."""

    def __init__(self, broker: Any, host: str) -> None:
        broker.worker(host)  # a host nobody knows is refused here, naming it
        self.broker = broker
        self.host = host
        self._sent: set[str] = set()
        self._keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def _key(self, part: Any) -> str:
        # From a counter, never id(): a later part may get the id of one that is gone, and
        # the worker would run the old one in its place.
        key = self._keys.get(part)
        if key is None:
            key = self._keys[part] = f"p{next(_pkeys)}"
        return key

    def forward(
        self, part: Any, inputs: dict[str, Any], *, store: Any = None, watching: Any = None
    ) -> dict[str, Any]:
        """Run `part` on its worker; answer `{exit: value}` (tensors keep `requires_grad`)."""
        key = self._key(part)
        defs: list[dict] = []
        described = None
        if key not in self._sent:
            self._refuse_untrained(part)
            described = self._describe(part, defs)
        message = {
            "op": "stage.forward",
            "pkey": key,
            "part": described,
            "define": defs,
            "inputs": inputs,
            "watching": watching is not None,  # else the worker runs it unwatched: no facts
        }
        got = self._ask(part, message)
        self.broker.defined(self.host, defs)
        self._sent.add(key)
        if watching is not None:
            for fact in got["facts"]:
                watching(fact)
        return got["outs"]

    def backward(self, part: Any, envelopes: dict[str, Any]) -> dict[str, Any]:
        """Hand the part on its worker what it owes; answer `{source: Envelope}`."""
        from somatize.torch.training.learning import envelope

        sent = {n: [e.gradient, bool(e.closing)] for n, e in envelopes.items()}
        message = {"op": "stage.backward", "pkey": self._key(part), "envelopes": sent}
        got = self._ask(part, message)
        return {s: envelope(g, closing) for s, (g, closing) in got.items()}

    def _ask(self, part: Any, message: dict[str, Any]) -> Any:
        from somatize.torch.training.learning import OutOfStep

        try:
            return self.broker.request(self.host, message)
        except Unknown as lost:
            self._sent.clear()
            self.broker.forget(self.host)
            raise OutOfStep(
                f"the worker for host {self.host!r} no longer holds {part!r}: it was restarted "
                "and lost what the stage kept (the activation, and the weights it learnt there). "
                "Load the weights again (Trainer.load) and take the step again"
            ) from lost

    def _refuse_untrained(self, part: Any) -> None:
        from somatize.torch.training.trainer import NoGradient

        idle = [
            n
            for n in part.ids
            if n != part.trained and not part.settings[n].frozen and _hooks.trainable(part.nodes[n])
        ]
        if idle:
            n = idle[0]
            raise NoGradient(
                f"node {n!r} runs on host {self.host!r} and nothing trains it there: a gradient "
                "does not cross a wire by itself, so the optimizer here would never move it. "
                f"Train it where it runs, Trainer(..., trains={{{n!r}: Split(SGD, lr=...)}}) "
                "with the optimizer over parameters(g, without=trains), or declare it .frozen()"
            )

    def _describe(self, part: Any, defs: list[dict]) -> dict[str, Any]:
        broker, host = self.broker, self.host
        keys = {}
        for n in part.ids:
            node = part.nodes[n]
            d = broker.definition(host, n, node, part.settings[n].device)
            if d is not None:
                defs.append(d)
            keys[n] = broker.key(node)
        learning = None
        if part.learning is not None:
            d = broker.definition(host, f"{part.trained}/learning", part.learning, None)
            if d is not None:
                defs.append(d)
            learning = {"key": broker.key(part.learning), "told": part.learning.told()}
        return {
            "ids": list(part.ids),
            "keys": keys,
            "settings": {
                n: {f.name: getattr(s, f.name) for f in fields(s)} for n, s in part.settings.items()
            },
            "preds": {n: list(part.preds[n]) for n in part.ids},
            "succ": {n: _successors(part, n) for n in part.ids},
            "stage": part.stage,
            "trained": part.trained,
            "last": part.last,
            "learning": learning,
        }


def _successors(part: Any, n: str) -> list[str]:
    from somatize.torch.training.stages import LOSS

    inside = [m for m in part.ids if n in part.preds[m]]
    outside = [d for s, d in part.leaving if s == n and d != LOSS]
    return inside + outside


class _View:
    """The little a `Part` asks of a graph, for a part rebuilt on a worker."""

    def __init__(self, nodes: dict, settings: dict, preds: dict, succ: dict) -> None:
        self._nodes, self._settings, self._preds, self._succ = nodes, settings, preds, succ

    def implementation(self, n: str) -> Any:
        return self._nodes[n]

    def setting(self, n: str) -> Any:
        return self._settings[n]

    def predecessors(self, n: str) -> list[str]:
        return list(self._preds.get(n, ()))

    def successors(self, n: str) -> list[str]:
        return list(self._succ.get(n, ()))


def serve_stage(server: Any, session: str, nodes: dict[str, Any], op: str, m: dict) -> Any:
    """The worker's side: `stage.forward` (rebuilding the part the first time) and
    `stage.backward`. A part the worker does not hold is `Unknown` (it was restarted)."""
    key = (session, m["pkey"])
    if op == "stage.forward":
        part = server.stages.get(key)
        if m.get("part") is not None:
            part = server.stages[key] = _rebuilt(server, nodes, m["part"])
        if part is None:
            raise Unknown(f"this worker does not hold the stage {m['pkey']!r}: it was restarted")
        facts: list[dict] = []
        watching = facts.append if m.get("watching", True) else None
        outs = part.forward(m["inputs"], watching=watching)
        return {"outs": outs, "facts": facts}
    if op == "stage.backward":
        from somatize.torch.training.learning import envelope

        part = server.stages.get(key)
        if part is None:
            raise Unknown(f"this worker does not hold the stage {m['pkey']!r}: it was restarted")
        envelopes = {n: envelope(g, closing) for n, (g, closing) in m["envelopes"].items()}
        back = part.backward(envelopes)
        return {s: [e.gradient, bool(e.closing)] for s, e in back.items()}
    raise ValueError(f"unknown request {op!r}")


def _rebuilt(server: Any, nodes: dict[str, Any], d: dict[str, Any]) -> Any:
    from somatize.node import Settings
    from somatize.torch.training.stages import Part

    mine = {n: server.node(nodes, k) for n, k in d["keys"].items()}
    settings = {n: Settings(**s) for n, s in d["settings"].items()}
    view = _View(mine, settings, d["preds"], d["succ"])
    learning = None
    if d["learning"] is not None:
        said = d["learning"]
        learning = server.node(nodes, said["key"])
        learning.of(mine[d["trained"]]).tell(**said["told"])
    return Part(
        view,
        d["ids"],
        stage=d["stage"],
        host=None,
        learning=learning,
        trained=d["trained"],
        last=d["last"],
        whole=False,
    )
