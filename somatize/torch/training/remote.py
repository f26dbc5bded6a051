"""A trainer's stage on a worker: the remote transport of `somatize.torch.training.stages`.

`Remote(broker, host)` answers the two calls `stages.Part` answers in this process. The first
forward sends the part (its nodes, settings, edges and Learning) and the worker rebuilds it;
then a forward sends values and a backward envelopes, one round trip each. The worker keeps
the activation in between, so a restarted one answers `OutOfStep`; every step marks the part's
nodes as learnt there, so a worker that lost them is `StateLost` rather than sent older
weights from here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from somatize import _hooks, run
from somatize.codecs import NoCodec
from somatize.node import Settings, note
from somatize.remote import wire
from somatize.remote.errors import Unknown
from somatize.torch.training.learning import OutOfStep, envelope
from somatize.torch.training.stages import INPUT, TARGET, Part

__all__ = ["Remote", "serve_stage"]


class Remote:
    """Runs a trainer's part on the worker of `host`, through `broker`."""

    def __init__(self, broker: Any, host: str) -> None:
        broker.worker(host)  # a host nobody knows is refused here, naming it
        self.broker = broker
        self.host = host
        self.audit: Any = None  # the Trainer's Audit: the parts' nodes are measured there

    def forward(
        self, part: Any, inputs: dict[str, Any], *, store: Any = None, watching: Any = None
    ) -> dict[str, Any]:
        """Run `part` on its worker; answer `{exit: value}` (tensors keep `requires_grad`). A
        worker that no longer holds the part is sent it again, once (`StateLost` if it had learnt
        there since its weights were last read back). A `.cached()` node in it, with a `store`,
        is refused as `Graph.forward` refuses it, before anything is sent."""
        broker, host = self.broker, self.host
        if store is not None:
            _refuse_cached(broker, part, host, store)
        message = {
            "op": "stage.forward",
            "inputs": inputs,
            "watching": watching is not None,  # else the worker runs it unwatched
        }
        if self.audit is not None:  # the step its Audit there measures (None: no longer)
            message["step"] = self.audit.step if self.audit.watching else None
        held = _held(part)
        try:
            got = broker.send(host, held, message, (part.key, lambda: self._describe(part)))
        except NoCodec as error:
            raise _unsent(part, inputs, host, error) from None
        broker.learnt(host, held)
        if watching is not None:
            for fact in got["facts"]:
                watching(fact)
        return got["outs"]

    def backward(self, part: Any, envelopes: dict[str, Any]) -> dict[str, Any]:
        """Hand the part on its worker what it owes; answer `{source: Envelope}`."""
        sent = {n: [e.gradient, bool(e.closing)] for n, e in envelopes.items()}
        message = {"op": "stage.backward", "kept": part.key, "envelopes": sent}
        try:
            got = self.broker.request(self.host, message)
        except Unknown as lost:
            raise OutOfStep(
                f"the worker for host {self.host!r} no longer holds {part!r}: it was restarted "
                "(or forgot this client's session) and lost the activation this step left "
                "there. Take the step again; what its nodes had learnt there since their "
                "weights were last read back is lost too (StateLost says so at the next step)"
            ) from lost
        self.broker.learnt(self.host, _held(part))
        if got["facts"] and self.audit is not None:
            self.audit.heard(got["facts"])
        return {s: envelope(g, closing) for s, (g, closing) in got["owed"].items()}

    def _describe(self, part: Any) -> dict[str, Any]:
        # asked whenever the part is sent, so once a worker: refuse a node nothing trains there
        from somatize.torch.training.trainer import NoGradient

        for n in part.ids:
            if n == part.trained or part.settings[n].frozen or not _hooks.trainable(part.nodes[n]):
                continue
            raise NoGradient(
                f"node {n!r} runs on host {self.host!r} and nothing trains it there: a gradient "
                "does not cross a wire by itself, so the optimizer here would never move it. "
                f"Train it where it runs, Trainer(..., trains={{{n!r}: Split(SGD, lr=...)}}) "
                "with the optimizer over parameters(g, without=trains), or declare it .frozen()"
            )
        broker = self.broker
        learning = None
        if part.learning is not None:
            told = broker.portable(self.host, part.learning.told())
            learning = {"key": broker.key(part.learning), "told": told}
        return {
            "ids": part.ids,
            "keys": {n: broker.key(part.nodes[n]) for n in part.ids},
            "settings": {n: vars(s) for n, s in part.settings.items()},
            "preds": part.preds,
            "succ": part.succ,
            "stage": part.stage,
            "trained": part.trained,
            "last": part.last,
            "learning": learning,
            "audit": None if self.audit is None else self.audit.settings(part.ids),
        }


def _unsent(part: Any, inputs: dict[str, Any], host: str, error: NoCodec) -> NoCodec:
    """The `NoCodec` of a value sent to `part` that no codec writes down, naming the node that
    made it and the node it was sent to; `error` when it was another."""
    reader = {TARGET: part.trained}
    for source, node in part.entering:
        reader.setdefault(source, node)
    said = {INPUT: "the graph's input", TARGET: "the target"}
    parts = []
    for s, value in inputs.items():
        whose = said.get(s, f"the output of node {s!r}")
        parts.append((f"{whose}, sent to node {reader[s]!r} on host {host!r}", value))
    return wire.unwritable(parts, error)


def _refuse_cached(broker: Any, part: Any, host: str, store: Any) -> None:
    """A part holding a `.cached()` node, run with a store: `broker.forward`'s own refusal (a
    graph with `.at(host)` nodes is not cached yet), with a note naming the node."""
    cached = [n for n in part.ids if part.settings[n].cached]
    if cached:
        try:
            broker.forward(run.Plan(part.graph), store=store)  # refuses before it runs
        except ValueError as refused:
            note(refused, f"node {cached[0]!r} is .cached() and runs on host {host!r}")
            raise


def _held(part: Any) -> list[tuple[str, Any, str | None]]:
    """`(id, node, device)` of what a part's worker holds: its nodes, and its Learning."""
    held = [(n, part.nodes[n], part.settings[n].device) for n in part.ids]
    if part.learning is not None:
        held.append((f"{part.trained}/learning", part.learning, None))
    return held


def serve_stage(server: Any, session: Any, op: str, m: dict) -> Any:
    """The worker's side: `stage.forward` (rebuilding the part when it is sent) and
    `stage.backward`; a part the worker does not hold is `Unknown`."""
    if op not in ("stage.forward", "stage.backward"):
        raise ValueError(f"unknown request {op!r}")
    part = session.keep(m, "stage part", lambda d: _rebuilt(server, session, d))
    audited = part.audit
    if op == "stage.forward":
        if audited is not None:
            audited.at(m["step"])
        facts: list[dict] = []
        watching = facts.append if m.get("watching", True) else None
        outs = part.forward(m["inputs"], watching=watching)
        return {"outs": outs, "facts": facts}
    envelopes = {n: envelope(g, closing) for n, (g, closing) in m["envelopes"].items()}
    back = part.backward(envelopes)
    closed = audited is not None and any(e.closing for e in envelopes.values())
    return {
        "owed": {s: [e.gradient, bool(e.closing)] for s, e in back.items()},
        "facts": audited.closed() if closed else [],
    }


class _Audited:
    """A worker's Audit of the nodes of a part (`ids`): a step is observed once it is over
    (the next step's forward, or the group's end) and the facts go back, update_ratio and
    all, when the group closes and its Learning has stepped."""

    def __init__(self, audit: Any, ids: Any) -> None:
        self.audit = audit
        self.ids = set(ids)
        self.pending = False  # a forward of the audit's step ran, and it is not observed yet
        self.facts: list[dict[str, Any]] = []

    def at(self, step: int | None) -> None:
        if self.pending and step != self.audit.step:
            self._observe()
        self.audit.at(step)
        self.pending = step is not None

    def _observe(self) -> None:
        # (its Inlets and Outlets, named by what they carry, are watched too: not said)
        self.facts += [f for f in self.audit.observed() if f["node"] in self.ids]
        self.pending = False

    def closed(self) -> list[dict[str, Any]]:
        if self.pending:
            self._observe()
        self.audit.moved()
        facts, self.facts = self.facts, []
        return facts


def _rebuilt(server: Any, session: Any, d: dict[str, Any]) -> Part:
    mine = {n: session.node(k) for n, k in d["keys"].items()}
    settings = {n: Settings(**s) for n, s in d["settings"].items()}
    view = SimpleNamespace(  # the little a Part asks of a graph
        implementation=mine.__getitem__,
        setting=settings.__getitem__,
        predecessors=d["preds"].__getitem__,
        successors=d["succ"].__getitem__,
    )
    learning = None
    if d["learning"] is not None:
        said, nid = d["learning"], f"{d['trained']}/learning"
        learning = session.node(said["key"])
        told = said["told"]  # as Broker.portable sent it: as code, else by name
        if type(told) is dict and set(told) == {"code"}:
            told = server.unpickled(told["code"], nid)
        else:
            told = server.allowed.resolved(told, nid)
        learning.of(mine[d["trained"]]).tell(**told)
    part = Part(
        view,
        d["ids"],
        stage=d["stage"],
        host=None,
        learning=learning,
        trained=d["trained"],
        last=d["last"],
    )
    if d.get("audit") is not None:
        from somatize.torch.audit.audit import Audit

        part.audit = _Audited(Audit(**d["audit"]).watch(part.graph), part.ids)
    return part
