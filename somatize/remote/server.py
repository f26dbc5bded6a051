"""The worker's side: what it holds for each client session, and how it answers a request.

A request is read only once its seal verifies (`somatize.remote.seal`). Each client (a
`Broker`) has a session: its nodes, what it keeps built on them (forward slices, a trainer's
stage parts) and the weights it is loading; a session unused for `session_timeout` seconds is
forgotten, and so is, a little later, one whose client's connection went away. Without
`--accept-code` nothing is unpickled: a node is built only from the classes the worker was
allowed (`somatize.remote.allowed`); with it, a node or a Learning's objective may arrive as
code.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from somatize import _hooks
from somatize.remote import seal, wire
from somatize.remote.allowed import Allowed, construct
from somatize.remote.errors import not_held
from somatize.remote.slices import ServedSlice, run_served

__all__ = ["Server", "Session", "Drops"]

log = logging.getLogger("somatize.worker")

GONE_GRACE = 10.0
"""Seconds a session outlives its client's connection (a client that reconnects keeps it)."""


@dataclass
class Session:
    """What one client sent a worker: nodes by key, what it keeps built on them by key (forward
    slices, stage parts), and the weights it is loading; when it was last used, and over which
    connection."""

    nodes: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)
    last: float = field(default_factory=time.monotonic)
    connection: Any = None
    gone: float | None = None

    def node(self, key: Any) -> Any:
        """The node sent under `key`; a worker that does not hold it says so (`Unknown`)."""
        found = self.nodes.get(key)
        if found is None:
            raise not_held(f"node {key!r}")
        return found

    def keep(self, m: dict[str, Any], what: str, build: Callable[[Any], Any]) -> Any:
        """What request `m` runs (`what`: "forward slice", say), kept under its `kept` key:
        built by `build` from the `described` that came along, else as built before; one this
        worker does not hold is `Unknown` (the client sends it again)."""
        key, described = m.get("kept"), m.get("described")
        if type(key) is not str:
            raise wire.Malformed(f"a {what} is kept under a str key, not {key!r:.40}")
        if described is not None:
            self.kept[key] = build(described)
        found = self.kept.get(key)
        if found is None:
            raise not_held(f"the {what} {key!r}")
        return found


class Drops:
    """Dropped messages, logged at most once every `every` seconds (with how many since)."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.count = 0
        self._told = -float("inf")
        self._since = 0

    def drop(self, why: str) -> None:
        """Count one dropped message (`why`: what was wrong with it); log it unless one was
        logged less than `every` seconds ago."""
        self.count += 1
        self._since += 1
        now = time.monotonic()
        if now - self._told >= self.every:
            more = f" ({self._since - 1} more since the last said)" if self._since > 1 else ""
            log.warning("dropped a message: %s%s", why, more)
            self._told = now
            self._since = 0


class Server:
    """One worker's sessions, and the answer to each message (`handle`)."""

    def __init__(
        self,
        token: str,
        *,
        accept_code: bool = False,
        allowed: Allowed | None = None,
        session_timeout: float = 3600.0,
        max_message: int = 1 << 30,
    ) -> None:
        self.salt = os.urandom(16)
        self.seal = seal.Seal(seal.derive(token, self.salt))
        self.accept_code = accept_code
        self.allowed = allowed if allowed is not None else Allowed()
        self.session_timeout = float(session_timeout)
        self.max_message = max_message
        self.incarnation = secrets.token_hex(8)
        self.sessions: dict[str, Session] = {}
        self.served = 0
        self.drops = Drops()

    # -- one message --------------------------------------------------------------------------
    def handle(self, frames: list[Any], connection: Any = None) -> tuple[list | None, bool | None]:
        """The frames that answer one message (the peer's identity taken off), and whether it
        verified: True, False (refused), None for the one unsealed question (the salt).
        Whoever watches connections cuts those that never verify. `connection` names the
        connection it came over, exactly (the peer's identity): a session follows its
        client's."""
        if len(frames) == 1 and seal.is_frame(frames[0], seal.SALT_ASK):
            return seal.salt_answer(self.salt), None
        try:
            body = self.seal.open(frames)
        except seal.Refused as refused:
            self.drops.drop(f"{refused} (nothing in it was read)")
            return seal.refusal(self.salt, refused.reason), False
        try:
            size = sum(wire._buffer(f).nbytes for f in body)
            most = wire.MOST_MESSAGE * self.max_message
            if size > most:
                raise ValueError(
                    f"a message of {size} bytes, and this worker takes at most {most}, all "
                    "frames counted (four times its --max-message): start it with a larger "
                    "one, or send less at once"
                )
            message = wire.decode(body)
            if type(message) is not dict or type(message.get("op")) is not str:
                raise wire.Malformed("a sealed message that is not a request (no 'op')")
        except Exception as error:  # a token holder's bug: tell it, do not guess its rid
            self.drops.drop(f"{type(error).__name__}: {error}")
            return self._failed(None, error), True
        rid = message.get("rid")
        try:
            value = self.answer(message, connection)
        except Exception as error:
            return self._failed(rid, error), True
        finally:  # idle from when it was answered: a long request does not expire its session
            if (used := self.sessions.get(str(message.get("session", "")))) is not None:
                used.last = time.monotonic()
        self.served += 1
        reply = {"rid": rid, "ok": True, "worker": self.incarnation, "value": value}
        where = f"the answer to {message['op']!r}"
        try:
            return self.seal.seal(wire.encode(reply, where=where)), True
        except Exception as error:  # no codec for it, nested too deep: said as a store says it
            return self._failed(rid, self._unwritable(message, value, error)), True

    def _unwritable(self, m: dict[str, Any], value: Any, error: Exception) -> Exception:
        """The error of an answer that cannot be written down; a forward slice's, or a
        trainer's stage part's forward, names the node whose output it was."""
        session = self.sessions.get(str(m.get("session", "")))
        served = session.kept.get(m.get("kept")) if session is not None else None
        if m["op"] in ("run", "stage.forward") and hasattr(served, "unwritable"):
            return served.unwritable(value, error)
        return error

    def _failed(self, rid: Any, error: BaseException) -> list[Any]:
        """The answer that says `error`; where that cannot be written down (text that is not
        UTF-8 in its message, say), the same said in plain text, which always can."""
        reply = {"rid": rid, "ok": False, "worker": self.incarnation, "error": said(error)}
        try:
            return self.seal.seal(wire.encode(reply))
        except Exception:
            plain = {k: _plain(v) for k, v in reply["error"].items()}
            reply = {**reply, "rid": rid if type(rid) is int else None, "error": plain}
            return self.seal.seal(wire.encode(reply))

    # -- sessions -----------------------------------------------------------------------------
    def session(self, name: Any, connection: Any) -> Session:
        """The session `name`, made when first used, noted as used now over `connection`."""
        found = self.sessions.setdefault(str(name), Session())
        found.last = time.monotonic()
        if connection is not None:
            found.connection, found.gone = connection, None
        return found

    def gone(self, connection: Any) -> None:
        """A client's connection closed: its sessions go after `GONE_GRACE` seconds unless
        it comes back."""
        now = time.monotonic()
        for s in self.sessions.values():
            if s.connection == connection and s.gone is None:
                s.gone = now

    def expire(self) -> list[str]:
        """Forget the sessions idle for `session_timeout`, or whose client is gone; answers
        their names."""
        now = time.monotonic()
        grace = min(GONE_GRACE, self.session_timeout)
        old = [
            name
            for name, s in self.sessions.items()
            if now - s.last > self.session_timeout or (s.gone is not None and now - s.gone > grace)
        ]
        for name in old:
            del self.sessions[name]
        if old:
            log.info("forgot %d session(s) nobody used or whose client went away", len(old))
        return old

    # -- what it is asked ---------------------------------------------------------------------
    def answer(self, m: dict[str, Any], connection: Any = None) -> Any:
        """What one request asks for."""
        op = m["op"]
        if op == "hello":
            return self.hello()
        session = self.session(m.get("session", ""), connection)
        if op == "close":
            self.sessions.pop(m.get("session", ""), None)
            return True
        for d in m.get("define") or ():
            if type(d) is not dict:
                raise wire.Malformed(f"a definition that is not a dict: {d!r:.60}")
            key = d.get("key")
            if key in session.nodes:  # replaced: what was built on the old one is stale
                session.kept.clear()
            session.nodes[key] = self.rebuild(d)
        modes = m.get("modes") or {}  # the nodes whose train/eval modes changed (Broker.send)
        if type(modes) is not dict:
            raise wire.Malformed(f"modes that are not a dict: {modes!r:.60}")
        for key, said in modes.items():
            _hooks.set_modes(session.node(key), said)
        if op == "run":  # a forward slice, run without autograd
            served = session.keep(m, "forward slice", lambda d: ServedSlice(d, session.nodes))
            return run_served(served, m.get("given"), m.get("input"), m.get("watching") is True)
        if op == "define":
            return len(session.nodes)
        if op == "state":
            return _hooks.state_of(session.node(m.get("key")))
        if op == "load":
            return self.load(session, m)
        return _hooks.serve(self, session, op, m)

    def load(self, session: Session, m: dict[str, Any]) -> bool:
        """Weights loaded in two steps, so that several workers and the client change
        together or not at all: `stage` checks them against the node and keeps cast copies
        (changing nothing), `commit` copies every staged node in (keeping what it replaced),
        `undo` puts that back, `drop` forgets both."""
        phase, lid = m.get("phase"), m.get("load")
        if phase == "stage":
            key = m.get("key")
            commit = _hooks.stage_state(session.node(key), m.get("state"))
            session.loads.setdefault(lid, {"staged": {}, "undo": {}})["staged"][key] = commit
            return True
        found = session.loads.get(lid)
        if found is None:
            raise not_held(f"load {lid!r}")
        if phase == "commit":
            for key, commit in found["staged"].items():
                found["undo"][key] = commit()
            found["staged"] = {}
            return True
        if phase == "undo":
            for undo in found["undo"].values():
                undo()
        if phase in ("undo", "drop"):
            session.loads.pop(lid, None)
            return True
        raise ValueError(f"a load's phase is stage, commit, undo or drop, not {phase!r:.20}")

    def hello(self) -> dict[str, Any]:
        """Who this worker is: its incarnation, pid, what it accepts, what it imported."""
        return {
            "worker": self.incarnation,
            "pid": os.getpid(),
            "accept_code": self.accept_code,
            "imports": dict(self.allowed.versions),
            "python": sys.version.split()[0],
            "served": self.served,
            "sessions": len(self.sessions),
            "dropped": self.drops.count,
            "session_timeout": self.session_timeout,
            "max_message": self.max_message,
        }

    def rebuild(self, d: dict[str, Any]) -> Any:
        """A node from its definition: its class (by name, from what this worker may build;
        or as code, only with `--accept-code`), its constructor arguments and its weights (with
        their dtypes)."""
        nid = d.get("id")
        if d.get("code") is not None:
            cls, args = self.unpickled(d["code"], nid)
            node = construct(cls, args)
            from somatize.remote import code  # cloudpickle: only where code came

            code.recording(_hooks.state_modules(node))
        else:
            cls = self.allowed.node_class(d.get("module"), d.get("qualname"), nid, d.get("version"))
            node = construct(cls, self.allowed.resolved(d.get("args") or {}, nid))
        if d.get("state"):
            _hooks.stage_state(node, d["state"], dtypes=True)()  # each tensor's, as sent
        if d.get("device") is not None:
            _hooks.place(node, d["device"])
        return node

    def unpickled(self, code: Any, nid: Any) -> Any:
        """What was sent for node `nid` as code (`Broker.portable`, `describe`), unpickled
        only by a worker started with `--accept-code`."""
        if not self.accept_code:
            raise PermissionError(
                f"node {nid!r} was sent as code, and this worker was not started with "
                "--accept-code: it does not unpickle anything"
            )
        import cloudpickle

        try:
            return cloudpickle.loads(code)
        except ModuleNotFoundError as error:
            name = error.name or str(error)
            raise ModuleNotFoundError(
                f"node {nid!r} was sent as code that refers to module {name!r}, which this "
                f"worker cannot import: name it in the client's send= (Worker.at(..., "
                f"send=[{name!r}]), Worker.spawn(mode='network', send=[{name!r}])) so that "
                "its code travels along, or install it where the worker runs",
                name=error.name,
            ) from error


def _plain(text: Any) -> Any:
    """`text` (a str, or a list of them) as UTF-8 can carry it: what it cannot, escaped."""
    if type(text) is list:
        return [_plain(t) for t in text]
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def said(error: BaseException) -> dict[str, Any]:
    """An exception as an answer says it: its type by name, message, notes and traceback."""
    cls = type(error)
    return {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "message": str(error),
        "notes": [str(n) for n in getattr(error, "__notes__", None) or []],
        "traceback": "".join(traceback.format_exception(cls, error, error.__traceback__)),
    }
