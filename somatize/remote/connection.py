"""One connection from a client to a worker: sealed requests, their answers, and a watch on
the line.

A request waits for its answer under a deadline and watches the connection meanwhile: a
worker that dies mid-request is a `WorkerLost` naming the host within seconds (ZeroMQ
heartbeats catch a machine that vanished), never a hang. A request refused because the worker
was restarted (a new salt, `somatize.remote.seal`) is sent again under the new key: a refused
request was not run.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import struct
import sys
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from somatize.remote import seal, wire
from somatize.remote.errors import RemoteError, WorkerLost

__all__ = ["Connection", "rebuilt"]

_monitors = itertools.count(1)
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)


class Connection:
    """One DEALER socket to one worker, for the host named `host` (used in errors)."""

    def __init__(self, worker: Any, host: str, token: str) -> None:
        self.worker = worker
        self.host = host
        self.token = token
        self.lock = threading.Lock()
        self.seal: seal.Seal | None = None
        self.salt: bytes | None = None
        self.hello: dict[str, Any] | None = None
        self.mode: str | None = None  # how nodes travel there (`Worker.travels`)
        self.incarnation: str | None = None
        self.proven = False  # whether this connection's worker has verified a message of ours
        self._rid = itertools.count(secrets.randbits(40) << 20)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 500)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 2500)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RCVTIMEO, 250)  # a wait for the answer looks at the line this often
        if worker.server_key:
            sock.curve_serverkey = worker.server_key.encode()
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_FAILED)  # bits
        # an address of its own: pyzmq's default is named after the socket's descriptor, which
        # a new socket reuses while a closed one's monitor may not be reaped yet
        self.monitor = sock.get_monitor_socket(
            events, addr=f"inproc://somatize-monitor-{os.getpid()}-{next(_monitors)}"
        )
        sock.connect(worker.address)
        self.sock = sock
        self.up = False
        self.reached = False  # the worker was reached at least once (a handshake succeeded)
        self.down_since = time.monotonic()

    def where(self) -> str:
        """The host and the worker's address, as errors name them."""
        return f"host {self.host!r} (worker at {self.worker.address})"

    def _events(self) -> bool:
        """Read what the monitor saw; whether the connection went down (it may come back)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = self.reached = True
            elif event in _FAILED:
                raise PermissionError(
                    f"{self.where()}: the worker's CURVE key is not the one given "
                    "(Worker.at(..., server_key=...) must be its public key), or it does not "
                    "encrypt (leave server_key out)"
                    if self.worker.server_key
                    else f"{self.where()}: the worker encrypts (CURVE): give its public key, "
                    "Worker.at(..., server_key=...)"
                )
            elif event == zmq.EVENT_DISCONNECTED and self.up:
                self.up = False
                self.proven = False
                self.down_since = time.monotonic()
                return True
        return False

    # -- the key ------------------------------------------------------------------------------
    def _agree(self, deadline: float) -> None:
        """Ask the worker for its salt and clock; derive the key under it."""
        asked = time.time()
        self.sock.send(seal.SALT_ASK)
        started = time.monotonic()
        while True:
            frames = self._receive(started, deadline)
            if len(frames) == 3 and seal.is_frame(frames[0], seal.SALT):
                salt, clock = bytes(frames[1].buffer), bytes(frames[2].buffer)
                if len(salt) == 16 and len(clock) == 8:
                    break
        (theirs,) = struct.unpack("<d", clock)
        offset = theirs - (asked + time.time()) / 2
        self.salt = salt
        self.seal = seal.Seal(seal.derive(self.token, salt), offset=offset)

    # -- a request ----------------------------------------------------------------------------
    def request(
        self, message: dict[str, Any], *, deadline: float | None = None, session: Any = None
    ) -> Any:
        """Send `message` (with `session` added when given), wait for its answer, and give
        back its value or raise its error (as its own type when it can be rebuilt here)."""
        deadline = self.worker.deadline if deadline is None else deadline
        with self.lock:
            self._events()  # lost between requests, it may be back: this request will tell
            if not self.proven and message.get("op") != "hello":
                # the worker weighs what an unproven connection sends: a small sealed hello
                self.hello = self._exchange({"op": "hello"}, deadline, None)
            return self._exchange(message, deadline, session)

    def _exchange(self, message: dict[str, Any], deadline: float, session: Any) -> Any:
        rid = next(self._rid)
        message = {**message, "rid": rid}  # the caller's dict left alone
        if session is not None:
            message["session"] = session
        frames = wire.encode(message, where=f"a request to {self.where()}")
        most = (self.hello or {}).get("max_message")
        sizes = [memoryview(f).nbytes for f in frames]
        if most and (max(sizes) > most or sum(sizes) > wire.MOST_MESSAGE * most):
            raise ValueError(
                f"a request to {self.where()} holds a frame of {max(sizes)} bytes and "
                f"{sum(sizes)} in all, and that worker takes frames of at most {most} and "
                f"messages of at most {wire.MOST_MESSAGE * most} (start it with a larger "
                "--max-message, or send less at once)"
            )
        for _attempt in range(3):
            if self.seal is None:
                self._agree(deadline)
            self.sock.send_multipart(self.seal.seal(frames), copy=False)
            answered, value = self._wait(rid, deadline)
            if answered:
                return value
            salt, reason = value
            # a new worker at that address, or it waited too long in the worker's queue
            # (or the clocks moved apart): agree on the key again, seal anew
            if not (reason == "stale" or (reason == "seal" and salt != self.salt)):
                break
            self.seal = None
        if reason == "seal":
            raise PermissionError(
                f"{self.where()} refused the request: the token does not match "
                "(Worker.at(..., token=...) or SOMATIZE_TOKEN must be the worker's)"
            )
        raise PermissionError(f"{self.where()} refused the request as {reason}")

    def _wait(self, rid: int, deadline: float) -> tuple[bool, Any]:
        """Wait for the answer to `rid`: `(True, value)`, or `(False, (salt, reason))` when
        the worker refused it; raise the error it answered with."""
        started = time.monotonic()
        while True:
            frames = self._receive(started, deadline)
            if len(frames) == 3 and seal.is_frame(frames[0], seal.REFUSED):
                why = bytes(frames[2].buffer).decode(errors="replace")
                return False, (bytes(frames[1].buffer), why)
            try:
                body = self.seal.open(frames)
            except seal.Refused:
                continue  # not sealed with this key (or from before): not our answer
            try:
                reply = wire.decode(body)
            except wire.Malformed as error:  # sealed by the worker: an answer, unreadable here
                said = f"the answer of {self.where()} cannot be read here: {error}"
                raise wire.Malformed(said) from None
            if type(reply) is not dict or reply.get("rid") not in (rid, None):
                continue  # the late answer to a request that was given up on
            self.incarnation = reply.get("worker")
            self.proven = True
            if reply.get("ok") is True:
                return True, reply.get("value")
            raise rebuilt(reply.get("error") or {}, self.where())

    def _receive(self, started: float, deadline: float) -> list[Any]:
        """The next message on the socket; meanwhile, every 250 ms a look at the line, the
        deadline and a spawned worker's process."""
        while True:
            try:
                return self.sock.recv_multipart(copy=False)
            except zmq.Again:
                pass
            if self._events():
                raise WorkerLost(f"{self.where()} went away during a request")
            now = time.monotonic()
            unreachable = now - max(started, self.down_since)
            if not self.up and unreachable > self.worker.connect_within:
                raise WorkerLost(
                    f"nothing answers for {self.where()} after {unreachable:.0f} s: is the "
                    "worker running (python -m somatize.worker --listen HOST:PORT)?"
                )
            if now - started > deadline:
                raise TimeoutError(
                    f"{self.where()} did not answer within the deadline of {deadline:.0f} s"
                )
            child = self.worker.child
            code = child.process.poll() if child is not None else None
            if code is not None:
                said = "\n".join(child.printed)
                raise WorkerLost(
                    f"{self.where()} died (exit code {code}) during a request"
                    + (f"; it said:\n{said}" if said else "")
                )

    def close(self) -> None:
        """Close the socket (nothing is sent)."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def rebuilt(said: dict[str, Any], where: str) -> BaseException:
    """The worker's exception, as its own type when that is a builtin exception or one of
    somatize's already imported here (nothing is imported, no attribute path followed);
    otherwise a `RemoteError` naming it. Notes name the host and carry the traceback."""
    module, qualname = str(said.get("module", "")), str(said.get("qualname", ""))
    message = str(said.get("message", ""))
    error: BaseException | None = None
    if module == "builtins" or module.split(".")[0] == "somatize":
        found = vars(sys.modules[module]).get(qualname) if module in sys.modules else None
        if isinstance(found, type) and issubclass(found, Exception):
            with contextlib.suppress(Exception):
                error = found(message)
    if error is None:
        error = RemoteError(f"{module}.{qualname}: {message}")
    notes = [str(n) for n in said.get("notes") or []]
    traceback = "the worker's traceback:\n" + str(said.get("traceback", ""))
    error.__notes__ = [*notes, f"on {where}", traceback]
    return error
