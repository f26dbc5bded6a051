"""The client side: `Worker` (where one is) and the connection that talks to it.

A `Worker` is a declaration: `Worker.at("node3:7000")` opens nothing until work is sent.
`Worker.spawn()` starts one as a child process of this one (for tests, demos, notebooks),
waits until it is ready, and stops it when it is closed or when this interpreter exits.

A request waits for its answer under a deadline, and while it waits it watches the
connection: a worker that dies mid-request is a `WorkerLost` naming the host within a second
or two (ZeroMQ heartbeats catch a machine that vanished without closing its socket), never a
hang.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from somatize.remote import wire
from somatize.remote.memory import keep_buffers
from somatize.remote.wire import receive

__all__ = ["Worker", "WorkerLost", "RemoteError", "Connection"]

_spawned: weakref.WeakSet[Worker] = weakref.WeakSet()


class WorkerLost(ConnectionError):
    """The worker went away (or never answered) while a request was waiting for it."""


class RemoteError(RuntimeError):
    """A failure on a worker whose exception type cannot be rebuilt here; says what it was."""


class Worker:
    """Where a worker is: an address, the token to sign with, and (optionally) its CURVE key.

    `Worker.at(...)` names one that is already standing; `Worker.spawn(...)` starts one.
    Nothing opens until work is sent.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        server_key: str | None = None,
        deadline: float = 300.0,
        connect_within: float = 10.0,
    ) -> None:
        if not isinstance(address, str) or not address:
            raise ValueError(f"a worker's address is 'host:port', not {address!r}")
        self.address = address if "://" in address else f"tcp://{address}"
        self.token = token
        self.server_key = server_key
        self.deadline = float(deadline)
        self.connect_within = float(connect_within)
        self.process: subprocess.Popen | None = None

    @classmethod
    def at(
        cls,
        address: str,
        *,
        token: str | None = None,
        server_key: str | None = None,
        deadline: float = 300.0,
    ) -> Worker:
        """A worker already standing at `address` ("host:port" or "tcp://host:port").

        `token` defaults to `$SOMATIZE_TOKEN`; `server_key` is the worker's CURVE public key
        (z85) when it encrypts; `deadline` is how long one request may take, in seconds.
        """
        return cls(address, token=token, server_key=server_key, deadline=deadline)

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str] = (),
        *,
        token: str | None = None,
        encrypt: bool = False,
        env: dict[str, str] | None = None,
        ready_within: float = 60.0,
        deadline: float = 300.0,
        quiet: bool = True,
    ) -> Worker:
        """Start a worker as a child process on 127.0.0.1 and wait until it is ready.

        `argv` is extra arguments for `python -m somatize.worker` (say `["--accept-code"]`);
        `quiet=True` (the default) passes `--quiet`: the child logs warnings only, so a
        notebook does not show its "serving on" line.
        A token is made up unless given; `encrypt=True` makes up CURVE keys too. The child has
        this interpreter and its import path, runs in its own process group, and is stopped
        by `stop()`, by closing a broker that holds it, or when this interpreter exits (and
        it stops itself if this process dies without saying so). Refuses a child that is not
        ready within `ready_within` seconds, with what it printed.
        """
        token = token or secrets.token_hex(32)
        child_env = dict(os.environ if env is None else env)
        child_env["SOMATIZE_TOKEN"] = token
        paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
        child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        public = None
        if encrypt:
            public, secret = zmq.curve_keypair()
            child_env["SOMATIZE_CURVE_SECRET"] = secret.decode()
        command = [
            sys.executable,
            "-m",
            "somatize.worker",
            "--listen",
            "127.0.0.1:0",
            "--parent",
            str(os.getpid()),
            *argv,
        ]
        if quiet and "--quiet" not in argv:
            command.append("--quiet")
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
        line = _first_line(process, ready_within)
        if not line.startswith("somatize worker ready "):
            _stop(process)
            raise RuntimeError(
                f"the spawned worker ({' '.join(command[1:])}) was not ready within "
                f"{ready_within:.0f} s (exit code {process.poll()}); it said: {line!r}"
            )
        address = line.split()[3]
        worker = cls(
            address,
            token=token,
            server_key=public.decode() if public else None,
            deadline=deadline,
        )
        worker.process = process
        _spawned.add(worker)
        return worker

    def stop(self) -> None:
        """Stop a spawned worker (and everything in its process group); no-op for `at`."""
        if self.process is not None:
            _stop(self.process)

    @property
    def pid(self) -> int | None:
        """The process id of a spawned worker, or None."""
        return self.process.pid if self.process is not None else None

    def connect(self, host: str) -> Connection:
        """A new connection to this worker, for the host named `host` (used in errors)."""
        token = self.token or os.environ.get("SOMATIZE_TOKEN")
        if not token:
            raise ValueError(
                f"no token for host {host!r} ({self.address}): pass Worker.at(..., token=...) "
                "or set SOMATIZE_TOKEN to the worker's token"
            )
        return Connection(self, host, token)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        spawned = f", pid {self.pid}" if self.process is not None else ""
        return f"Worker({self.address!r}{spawned})"


def _first_line(process: subprocess.Popen, within: float) -> str:
    import selectors

    assert process.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(process.stdout, selectors.EVENT_READ)
    ends = time.monotonic() + within
    got = b""
    try:
        while b"\n" not in got:
            left = ends - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                break
            got += chunk
    finally:
        sel.close()
        process.stdout.close()
    return got.decode(errors="replace").strip()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        process.terminate()
    try:
        process.wait(3)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(3)


@atexit.register
def _stop_all() -> None:
    for worker in list(_spawned):
        worker.stop()


# Plain ints: `x & zmq.POLLIN` goes through the enum module's Python (~1 µs a request).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_context: zmq.Context | None = None
_rids = itertools.count(1)
_monitors = itertools.count(1)  # each connection's monitor has an inproc address of its own


def _zmq() -> zmq.Context:
    global _context
    if _context is None:
        keep_buffers()  # before ZeroMQ's I/O thread makes its first allocation
        _context = zmq.Context()
    return _context


class Connection:
    """One DEALER socket to one worker: signed requests, deadlines, and a watch on the line."""

    def __init__(self, worker: Worker, host: str, token: str) -> None:
        self.worker = worker
        self.host = host
        self.token = token
        self.lock = threading.Lock()
        sock = _zmq().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 500)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 2500)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        if worker.server_key:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey = worker.server_key.encode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        # an address of its own: pyzmq's default is named after the socket's file descriptor,
        # which a new socket reuses while a closed one's monitor may not be reaped yet
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED,
            addr=f"inproc://somatize-monitor-{os.getpid()}-{next(_monitors)}",
        )
        sock.connect(worker.address)
        self.sock = sock
        sock.setsockopt(zmq.RCVTIMEO, 250)  # a wait for the answer looks at the line this often
        self.up = False
        self.down_since = time.monotonic()
        self.incarnation: str | None = None
        self.hello: dict[str, Any] | None = None

    def _where(self) -> str:
        return f"host {self.host!r} (worker at {self.worker.address})"

    def _events(self) -> None:
        while self.monitor.getsockopt(_EVENTS) & _POLLIN:  # cheaper than a poll
            event = recv_monitor_message(self.monitor)["event"]
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self.up = True
            elif event == zmq.EVENT_DISCONNECTED:
                if self.up:
                    self.up = False
                    self.down_since = time.monotonic()
                    raise WorkerLost(f"{self._where()} went away")

    def request(
        self, message: dict[str, Any], *, deadline: float | None = None, session: Any = None
    ) -> Any:
        """Send `message` (with `session` added when given), wait for its answer, and give
        back its value (or raise its error)."""
        with self.lock:
            if self.monitor.getsockopt(_EVENTS) & _POLLIN:  # what `_events` looks at first
                try:
                    self._events()
                except WorkerLost:
                    pass  # lost between requests: it may be back; this request will tell
            rid = next(_rids)
            message = {**message, "rid": rid}  # one copy, the caller's dict left alone
            if session is not None:
                message["session"] = session
            frames = wire.pack(self.token, message, where=lambda: f"a request to {self._where()}")
            if len(frames) == 1:  # as `wire.send` sends it
                self.sock.send(frames[0], copy=True)
            else:
                wire.send(self.sock, frames)
            return self._wait(rid, deadline if deadline is not None else self.worker.deadline)

    def run(self, session: str, sid: str, given: dict, input: Any) -> Any:
        """What `request` gives back for `{"op": "run", "define": [], "sid": sid, "slice":
        None, "given": given, "input": input, "timed": False}` under `session` (a repeated
        forward of a slice the worker holds, nobody watching), the request written as a
        record without the dict (`wire.run_record`; as msgpack when it cannot be one)."""
        with self.lock:
            if self.monitor.getsockopt(_EVENTS) & _POLLIN:  # as `request` does
                try:
                    self._events()
                except WorkerLost:
                    pass
            rid = next(_rids)
            frames = wire.run_record(self.token, rid, session, sid, given, input)
            if frames is None:
                message = {
                    "op": "run",
                    "define": [],
                    "sid": sid,
                    "slice": None,
                    "given": given,
                    "input": input,
                    "timed": False,
                    "session": session,
                    "rid": rid,
                }
                frames = wire.pack(
                    self.token, message, where=lambda: f"a request to {self._where()}"
                )
            if len(frames) == 1:
                self.sock.send(frames[0], copy=True)
            else:
                wire.send(self.sock, frames)
            return self._wait(rid, self.worker.deadline)

    def _wait(self, rid: int, deadline: float) -> Any:
        sock = self.sock
        started = time.monotonic()
        while True:
            try:  # the answer, or every 250 ms a look at the line, the deadline and the child
                frame = sock.recv(copy=False)
                frames = receive(sock, frame) if frame.more else [frame]
            except zmq.Again:
                frames = None
            if frames is not None:
                try:
                    reply = wire.unpack(self.token, frames)
                except wire.Malformed:  # the worker's refusal is not a sealed message
                    if len(frames) == 1 and frames[0].buffer == wire.REFUSED:
                        raise PermissionError(
                            f"{self._where()} refused the request: the token does not match "
                            "(Worker.at(..., token=...) / SOMATIZE_TOKEN must be the worker's)"
                        ) from None
                    raise
                if not isinstance(reply, dict) or reply.get("rid") != rid:
                    continue  # the late answer to a request that was given up on
                self.incarnation = reply.get("worker")
                if reply["ok"]:
                    return reply["value"]
                raise _rebuilt(reply["error"], self._where())
            try:
                self._events()
            except WorkerLost as lost:
                raise WorkerLost(f"{lost} during a request") from None
            now = time.monotonic()
            unreachable = now - max(started, self.down_since)
            if not self.up and unreachable > self.worker.connect_within:
                raise WorkerLost(
                    f"nothing answers for {self._where()} after {unreachable:.0f} s: is the "
                    "worker running (python -m somatize.worker --listen HOST:PORT)?"
                )
            if now - started > deadline:
                raise TimeoutError(
                    f"{self._where()} did not answer within the deadline of {deadline:.0f} s"
                )
            process = self.worker.process
            if process is not None and process.poll() is not None:
                raise WorkerLost(
                    f"{self._where()} died (exit code {process.returncode}) during a request"
                )

    def close(self) -> None:
        """Close the socket (nothing is sent)."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)


def _rebuilt(said: dict[str, Any], where: str) -> BaseException:
    """The worker's exception, as its own type when that can be rebuilt here."""
    import importlib

    error: BaseException | None = None
    if said.get("unknown"):
        from somatize.remote.server import Unknown

        error = Unknown(said["message"])
    else:
        try:
            cls: Any = importlib.import_module(said["module"])
            for part in said["qualname"].split("."):
                cls = getattr(cls, part)
            if isinstance(cls, type) and issubclass(cls, Exception):
                error = cls(said["message"])
        except Exception:
            error = None
    if error is None:
        error = RemoteError(f"{said['module']}.{said['qualname']}: {said['message']}")
    notes = [*said.get("notes", []), f"on {where}", "the worker's traceback:\n" + said["traceback"]]
    error.__notes__ = notes  # type: ignore[attr-defined]
    return error
