"""The worker: a process that holds nodes sent to it and runs slices of graphs on them.

    python -m somatize.worker --listen 0.0.0.0:7000 --token "$SOMATIZE_TOKEN"

It serves one request at a time on a ZeroMQ ROUTER socket. Every message must be signed with
the shared token (`somatize.remote.wire`); one that is not, or that does not parse, is dropped
and logged, and the worker goes on serving. A client that vanishes mid-request costs nothing:
the answer is dropped by ZeroMQ. Nothing received is unpickled unless the worker was started
with ``--accept-code``; without it, a node arrives as its class's module and qualified name,
its constructor arguments and its weights, and the class must be importable here.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import secrets
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from somatize import _hooks
from somatize.remote import wire
from somatize.remote.memory import keep_buffers
from somatize.remote.wire import receive
from somatize.run import walk

__all__ = ["Compiled", "Server", "main", "rebuild"]

log = logging.getLogger("somatize.worker")
_MORE = int(zmq.SNDMORE)


class Server:
    """One worker's state and its loop: the nodes each client session sent, and the stages
    a remote trainer keeps between its forward and its backward."""

    def __init__(self, token: str, *, accept_code: bool = False) -> None:
        self.token = token
        self.accept_code = accept_code
        self.incarnation = secrets.token_hex(8)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.stages: dict[tuple[str, str], Any] = {}
        self.slices: dict[tuple[str, str], Compiled] = {}  # (session, slice id): compiled
        self.served = 0
        self.dropped = 0

    # -- the loop ---------------------------------------------------------------------------
    def serve(self, sock: zmq.Socket, stop: threading.Event | None = None) -> None:
        """Answer requests on `sock` until `stop` is set (or forever)."""
        sock.setsockopt(zmq.RCVTIMEO, 200)  # wait in the receive itself, looking up now and then
        while stop is None or not stop.is_set():
            try:
                frame = sock.recv(copy=False)  # the peer's identity, then the message
                frames = receive(sock, frame) if frame.more else [frame]
            except zmq.Again:
                continue
            if len(frames) < 2:
                self._drop("a message with no frames after the peer's identity")
                continue
            reply = self.handle(frames[1:])
            if reply is not None:
                try:
                    if len(reply) == 1:  # as `wire.send` sends it, the peer's frame first
                        sock.send(frames[0], _MORE)
                        sock.send(reply[0], copy=True)
                        continue
                    wire.send(sock, reply, prefix=[frames[0].bytes])
                except zmq.ZMQError as error:  # the client is gone: nothing to tell
                    log.info("could not answer a client that went away: %s", error)

    def _drop(self, why: str) -> None:
        self.dropped += 1
        log.warning("dropped a message: %s", why)

    def handle(self, frames: list[Any]) -> list[Any] | None:
        """The frames that answer one message, or None when it is dropped."""
        try:
            message = wire.unpack(self.token, frames)
        except wire.Refused as error:
            self._drop(f"{error} (nothing in it was read or run)")
            return [wire.REFUSED]
        except Exception as error:  # malformed in any way at all
            self._drop(f"{type(error).__name__}: {error}")
            return None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            self._drop("a signed message that is not a request (no 'op')")
            return None
        rid = message.get("rid")
        if (
            message.get("timed") is False
            and message.get("slice", 0) is None
            and message["op"] == "run"
            and not message.get("define")
        ):
            found = self._rerun(message, rid)
            if found is not None:
                return found
        try:
            value = self.answer(message)
        except Exception as error:
            return self._failed(rid, error)
        return self._written(rid, value, message["op"])

    def _rerun(self, m: dict[str, Any], rid: Any) -> list[Any] | None:
        """A repeated forward of a slice this worker holds, nobody watching (what the broker
        sends most): run as `answer` runs it, the answer written as a record without the
        generic answer's dicts. None when the generic path is to answer instead (the slice
        is not held, or the answer cannot be a record)."""
        session, sid = m.get("session", ""), m.get("sid")
        if type(session) is not str or type(sid) is not str:
            return None
        compiled = self.slices.get((session, sid))
        if compiled is None:
            return None
        grad = _grad_c or _grad()
        was = grad.is_grad_enabled()
        grad._set_grad_enabled(False)  # a plain forward: no autograd graph is kept
        try:
            out = _run_quiet(compiled, m.get("given"), m.get("input"))
        except Exception as error:
            return self._failed(rid, error)
        finally:
            grad._set_grad_enabled(was)
        frames = wire.answer_record(self.token, rid, self.incarnation, out)
        if frames is None:  # not all plain tensors: msgpack, as `handle` writes an answer
            return self._written(rid, {"out": out, "ran": []}, "run")
        self.served += 1
        return frames

    def _written(self, rid: Any, value: Any, op: Any) -> list[Any]:
        """The answer to `op` carrying `value`, as msgpack (or the error that it cannot be
        written down)."""
        reply = {"rid": rid, "ok": True, "worker": self.incarnation, "value": value}
        self.served += 1
        try:
            return wire.pack(self.token, reply, where=lambda: f"the answer to {op!r}")
        except Exception as error:
            problem = TypeError(f"the answer could not be written down: {error}")
            problem.__cause__ = error
            return self._failed(rid, problem)

    def _failed(self, rid: Any, error: BaseException) -> list[Any]:
        """The answer saying the request failed, and how."""
        reply = {"rid": rid, "ok": False, "worker": self.incarnation, "error": _said(error)}
        return wire.pack(self.token, reply)

    # -- what it is asked -------------------------------------------------------------------
    def answer(self, m: dict[str, Any]) -> Any:
        """What one request asks for."""
        op = m["op"]
        if op == "hello":
            return self.hello()
        session = m.get("session", "")
        if type(session) is not str:
            session = str(session)
        nodes = self.sessions.get(session)
        if nodes is None:
            nodes = self.sessions[session] = {}
        for d in m.get("define") or ():  # a repeated run defines nothing
            key = d["key"]
            if key in nodes:  # a node replaced: slices compiled on the old one are stale
                self._forget_slices(session)
            nodes[key] = self.rebuild(d)
        if op == "run":  # a plain forward: no autograd graph is kept for nobody
            steps = m.get("slice")
            if steps is None:  # a slice compiled before: found by its id
                compiled = self.slices.get((session, m.get("sid")))
                if compiled is None:
                    compiled = self.compiled(session, nodes, m.get("sid"), None)  # Unknown
            else:
                compiled = self.compiled(session, nodes, m.get("sid"), steps)
            grad = _grad_c or _grad()
            was = grad.is_grad_enabled()
            grad._set_grad_enabled(False)
            try:
                return run_compiled(compiled, m.get("given"), m.get("input"), m.get("timed", True))
            finally:
                grad._set_grad_enabled(was)
        if op == "define":
            return len(nodes)
        if op == "state":
            return _hooks.state_of(self.node(nodes, m["key"]))
        if op == "load":
            _hooks.load_state(self.node(nodes, m["key"]), m["state"])
            return True
        if op == "close":
            self.sessions.pop(session, None)
            self._forget_slices(session)
            for k in [k for k in self.stages if k[0] == session]:
                del self.stages[k]
            return True
        return _hooks.serve(self, session, nodes, op, m)

    def _forget_slices(self, session: str) -> None:
        for k in [k for k in self.slices if k[0] == session]:
            del self.slices[k]

    def compiled(self, session: str, nodes: dict[str, Any], sid: Any, steps: Any) -> Compiled:
        """The slice `sid` of a session, compiled from `steps` when they are sent (and kept
        under `sid` as long as the session's nodes), else as compiled before: a repeated
        forward sends only its id and its inputs."""
        if steps is not None:
            found = Compiled(steps, nodes)
            if isinstance(sid, str):
                self.slices[(session, sid)] = found
            return found
        found = self.slices.get((session, sid))
        if found is None:
            raise Unknown(
                f"this worker does not hold slice {sid!r}: it was restarted, or never sent it"
            )
        return found

    def hello(self) -> dict[str, Any]:
        """Who this worker is: its incarnation, pid, and whether it accepts code."""
        return {
            "worker": self.incarnation,
            "pid": os.getpid(),
            "accept_code": self.accept_code,
            "python": sys.version.split()[0],
            "served": self.served,
            "dropped": self.dropped,
        }

    def node(self, nodes: dict[str, Any], key: str) -> Any:
        """The node a session sent under `key`; a worker that lost it says so."""
        found = nodes.get(key)
        if found is None:
            raise Unknown(
                f"this worker does not hold node {key!r}: it was restarted, or never sent it"
            )
        return found

    def rebuild(self, d: dict[str, Any]) -> Any:
        """A node from its definition: its class, constructor arguments and weights."""
        if d.get("pickled") is not None:
            if not self.accept_code:
                raise PermissionError(
                    f"node {d.get('id')!r} was sent as code, and this worker was not started "
                    "with --accept-code: it does not unpickle anything"
                )
            import cloudpickle

            cls, args = cloudpickle.loads(d["pickled"])
        else:
            cls = importable(d["module"], d["qualname"], d.get("id"))
            args = d["args"]
        return rebuild(cls, args, d.get("state"), d.get("device"))


class Unknown(LookupError):
    """The worker does not hold a node the request names (it was restarted)."""


def importable(module: str, qualname: str, nid: Any = None) -> type:
    """The node class `module.qualname`, imported here; anything but a Node class refused."""
    from somatize.node import Node

    if "<locals>" in qualname:
        raise ImportError(
            f"node {nid!r}: class {qualname} is defined inside a function and cannot be "
            "imported by a worker; define it at module level, or start the worker with "
            "--accept-code"
        )
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"node {nid!r}: this worker cannot import {module}.{qualname} ({error}); install "
            "the module that defines it where the worker runs, or start the worker with "
            "--accept-code"
        ) from error
    if not (isinstance(obj, type) and issubclass(obj, Node)):
        raise TypeError(f"{module}.{qualname} is not a somatize Node class; refused")
    return obj


def rebuild(cls: type, args: dict[str, Any], state: Any = None, device: Any = None) -> Any:
    """`cls` built from its captured constructor arguments, then handed its weights."""
    node = _construct(cls, args)
    if state:
        _hooks.load_state(node, state)
    if device is not None:
        _hooks.place(node, device)
    return node


def _construct(cls: type, args: dict[str, Any]) -> Any:
    named = dict(args)
    if set(named) >= {"args"} and cls.__init__ is not object.__init__:
        try:
            inspect.signature(cls.__init__).bind(None, **named)
        except TypeError:  # captured as {"args": positional, **keywords}
            return cls(*named.pop("args"), **named)
    if cls.__init__ is object.__init__:
        return cls()
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if name not in named:
            continue
        value = named.pop(name)
        if p.kind is p.POSITIONAL_ONLY:
            positional.append(value)
        elif p.kind is p.VAR_POSITIONAL:
            positional.extend(value)
        else:
            keywords[name] = value
    keywords.update(named)  # what **kwargs gathered
    if positional:
        return cls(*positional, **keywords)
    return cls(**keywords)


class Compiled:
    """A slice compiled on a worker, once: its steps (`[slot, key, id, mode, src, device,
    host, mapped, wanted]`, as the broker describes them) checked and bound to the session's
    `nodes` as the engine's steps (`somatize.run.walk` runs them), and the slots whose values
    go back. A node the worker does not hold is `Unknown`.

    It stands in for a `Plan` where `walk` names a failing node: `ids` (slot → node id) and
    `graph.implementation(id)` (itself).
    """

    __slots__ = ("steps", "ids", "wanted", "held")

    def __init__(self, described: list[Any], nodes: dict[str, Any]) -> None:
        from somatize.run import MANY, ONE, ROOT, Ctx, _mapping

        steps = []
        self.ids: dict[int, str] = {}
        self.held: dict[str, Any] = {}
        wanted = []
        for slot, key, nid, mode, src, device, host, mapped, want in described:
            if mode == MANY:
                src = tuple((p, j) for p, j in src)
            elif mode not in (ONE, ROOT):
                raise ValueError(f"unknown step mode {mode!r}")
            node = nodes.get(key)
            if node is None:
                raise Unknown(
                    f"this worker does not hold node {nid!r}: it was restarted, or never sent it"
                )
            call = _hooks.entry(node)  # a module's __call__, so that its hooks fire
            fn = _mapping(nid, call) if mapped else call
            steps.append((slot, mode, src, fn, Ctx(nid, device, host, None), device))
            self.ids[slot] = nid
            self.held[nid] = node
            if want:
                wanted.append(slot)
        self.steps = tuple(steps)
        self.wanted = tuple(wanted)

    @property
    def graph(self) -> Compiled:
        """Itself (a property, not an attribute: no cycle keeps its nodes alive)."""
        return self

    def implementation(self, nid: str) -> Any:
        """The node that runs as `nid` (for `walk`'s note on a failure)."""
        return self.held[nid]


def run_compiled(compiled: Compiled, given: Any, input: Any, timed: bool = True) -> dict[str, Any]:
    """Run one slice of a plan, `Compiled` once, through the engine's own loop
    (`somatize.run.walk`: hooks fire, failures are noted with their node); `given` holds the
    values of the slots it reads from outside. Answers the values wanted outside and, when
    `timed` (somebody watches), per node when it began and how long it took (microseconds)."""
    if not timed:  # nobody watches: the engine's plain loop, no clock read
        return {"out": _run_quiet(compiled, given, input), "ran": []}
    vals: dict[int, Any] = dict(given) if given else {}
    ran: list[list[Any]] = []
    add = ran.append

    def told(fact: dict[str, Any]) -> None:
        add([fact["node"], fact["began_us"], fact["took_us"]])

    walk(compiled, compiled.steps, vals, input, [told], time.perf_counter_ns())
    out = {}
    for slot in compiled.wanted:
        out[slot] = vals[slot]
    return {"out": out, "ran": ran}


def _run_quiet(compiled: Compiled, given: Any, input: Any) -> dict[int, Any]:
    """`run_compiled`'s answer when nobody watches: the values wanted outside, by slot."""
    vals: dict[int, Any] = dict(given) if given else {}
    walk(compiled, compiled.steps, vals, input)
    out = {}
    for slot in compiled.wanted:
        out[slot] = vals[slot]
    return out


_grad_c: Any = None


def _grad() -> Any:
    """torch's C switch for autograd (what `torch.no_grad()` turns, without its Python
    context manager around it), looked up once."""
    global _grad_c
    if _grad_c is None:
        import torch

        _grad_c = torch._C
    return _grad_c


def _said(error: BaseException) -> dict[str, Any]:
    cls = type(error)
    return {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "message": str(error),
        "notes": [str(n) for n in getattr(error, "__notes__", None) or []],
        "traceback": "".join(traceback.format_exception(cls, error, error.__traceback__)),
        "unknown": isinstance(error, Unknown),
    }


# -- the command line ---------------------------------------------------------------------


def _endpoint(listen: str) -> str:
    if "://" in listen:
        return listen
    host, _, port = listen.rpartition(":")
    if not host or not port:
        raise SystemExit(f"--listen takes HOST:PORT (say 127.0.0.1:7000), not {listen!r}")
    return f"tcp://{host}:{'*' if port == '0' else port}"


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                log.warning("the process that spawned this worker is gone; stopping")
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="somatize-parent-watch").start()


def main(argv: list[str] | None = None) -> None:
    """`python -m somatize.worker --listen HOST:PORT [--token T] [--accept-code]
    [--curve-secret Z85] [--threads N] [--quiet]`: serve slices until stopped.

    `--quiet` logs warnings only (dropped messages, a parent gone), not the "serving on" line.
    """
    p = argparse.ArgumentParser(
        prog="python -m somatize.worker", description=__doc__.split("\n")[0]
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any free)")
    p.add_argument("--token", default=None, help="shared token (default: $SOMATIZE_TOKEN)")
    p.add_argument(
        "--accept-code",
        action="store_true",
        help="accept node classes as code (cloudpickle); only for clients you trust fully",
    )
    p.add_argument(
        "--curve-secret",
        default=None,
        help="this worker's CURVE secret key (z85; default $SOMATIZE_CURVE_SECRET): encrypt",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="log warnings only (no 'serving on' line)")
    p.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    keep_buffers()  # before any thread (torch's, ZeroMQ's) has a heap of its own
    logging.basicConfig(
        level=logging.WARNING if a.quiet else logging.INFO,
        stream=sys.stderr,
        format="somatize.worker %(levelname)s %(message)s",
    )
    token = a.token or os.environ.get("SOMATIZE_TOKEN")
    if not token:
        token = secrets.token_hex(32)
        log.warning("no --token or SOMATIZE_TOKEN: clients must use SOMATIZE_TOKEN=%s", token)
    import torch

    _hooks.ready()  # tensors, devices, stages: a worker without torch is no use

    if a.threads:
        torch.set_num_threads(a.threads)

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secret = a.curve_secret or os.environ.get("SOMATIZE_CURVE_SECRET")
    if secret:
        sock.curve_server = True
        sock.curve_secretkey = secret.encode()
        sock.curve_publickey = zmq.curve_public(secret.encode())
    sock.bind(_endpoint(a.listen))
    where = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    if a.parent is not None:
        _watch_parent(a.parent)
    server = Server(token, accept_code=a.accept_code)
    print(f"somatize worker ready {where} pid {os.getpid()}", flush=True)
    if a.parent is not None:  # the spawner reads one line; later prints go to stderr
        os.dup2(2, 1)
    log.info("serving on %s%s", where, " (accepts code)" if a.accept_code else "")
    try:
        server.serve(sock)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(0)
        context.term()
