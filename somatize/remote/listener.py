"""The worker's socket: limits applied before a message is read, a guard on its connections,
and the loop that hands each message to the `Server`.

ZeroMQ refuses a frame larger than `max_message` when its size is announced (nothing is
allocated for it) and queues at most `QUEUED` messages per connection. The guard cuts a
connection that has not sent a message that verifies: the one waiting longest when more than
`most_pending` are open (so that a client that has just connected gets in), any after
`PENDING_WITHIN` seconds, and one a second after it sent a message that does not verify. The
limit of open files is raised to its hard limit, at most half of what is left may be pending,
and running out of descriptors cuts the stranger waiting longest (logged at most every ten
seconds), never spun on.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["QUEUED", "PENDING_WITHIN", "Guard", "bind", "serve"]

log = logging.getLogger("somatize.worker")

QUEUED = 2
"""Messages a connection may have waiting while the worker is busy with another."""

PENDING_WITHIN = 10.0
"""Seconds a connection may stay open without sending a message that verifies."""

_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_MONITOR_STOPPED
)


def bind(context: zmq.Context, endpoint: str, *, max_message: int, curve_secret: str | None):
    """The worker's ROUTER socket, bound to `endpoint`, with its limits set first."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message))
    sock.setsockopt(zmq.RCVHWM, QUEUED)
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an answer to a client that left is an error
    if curve_secret:
        sock.curve_server = True
        sock.curve_secretkey = curve_secret.encode()
        sock.curve_publickey = zmq.curve_public(curve_secret.encode())
    sock.bind(endpoint)
    return sock


def _spare_descriptors() -> int:
    """How many more files this process may open."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        used = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    except (OSError, ValueError):
        return 1 << 10
    return max(0, soft - used) if soft != resource.RLIM_INFINITY else 1 << 16


def _cut(fd: int) -> None:
    """End the TCP connection on descriptor `fd` (libzmq's: it sees the end and closes it).
    No new descriptor is needed for it, which matters when they have run out."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.detach()  # the descriptor stays libzmq's


class Guard:
    """Watches the connections of `sock` on a thread of its own (see the module's doc)."""

    def __init__(self, sock: zmq.Socket, *, most_pending: int = 64) -> None:
        self.most_pending = max(1, min(int(most_pending), _spare_descriptors() // 2))
        self.lock = threading.Lock()
        self.pending: dict[int, float] = {}  # descriptor: when it was accepted
        self.closed: list[int] = []  # descriptors gone since the loop last asked
        self._told = -float("inf")
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.thread = threading.Thread(target=self._watch, daemon=True, name="somatize-guard")
        self.thread.start()

    def verified(self, fd: int, ok: bool) -> None:
        """A message from `fd` verified (`ok`: it is a client's, never cut) or did not (cut it
        a second from now, time for the refusal to reach it, unless it is a client's)."""
        with self.lock:
            if fd in self.pending and ok:
                del self.pending[fd]
            elif fd in self.pending:
                self.pending[fd] = min(self.pending[fd], time.monotonic() - PENDING_WITHIN + 1)

    def gone(self) -> list[int]:
        """The descriptors of the connections closed since the last call."""
        with self.lock:
            found, self.closed = self.closed, []
        return found

    def _watch(self) -> None:
        monitor = self.monitor
        while True:
            if monitor.poll(250):
                event = recv_monitor_message(monitor)
                kind, value = event["event"], event["value"]
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    break
                self._event(kind, value)
            self._sweep()
        monitor.close(0)

    def _event(self, kind: int, fd: int) -> None:
        cut = None
        with self.lock:
            if kind == zmq.EVENT_ACCEPTED:
                if len(self.pending) >= self.most_pending:
                    cut = self._longest()  # so that a client that has just connected gets in
                self.pending[fd] = time.monotonic()
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self.pending.pop(fd, None)
                self.closed.append(fd)
            elif kind == zmq.EVENT_ACCEPT_FAILED:  # `fd` is the errno here
                now = time.monotonic()
                if now - self._told > 10.0:
                    self._told = now
                    log.warning(
                        "could not accept a connection (%s): %d connection(s) waiting to say "
                        "anything that verifies",
                        os.strerror(fd),
                        len(self.pending),
                    )
                if fd in (errno.EMFILE, errno.ENFILE):
                    cut = self._longest()
        if cut is not None:
            _cut(cut)

    def _longest(self) -> int | None:
        """The stranger waiting longest, taken off the pending (to be cut), if there is one."""
        fd = min(self.pending, key=self.pending.__getitem__, default=None)
        self.pending.pop(fd, None)
        return fd

    def _sweep(self) -> None:
        now = time.monotonic()
        with self.lock:
            old = [fd for fd, at in self.pending.items() if now - at > PENDING_WITHIN]
            for fd in old:
                del self.pending[fd]
        for fd in old:
            _cut(fd)


def serve(sock: zmq.Socket, server: Any, guard: Guard) -> None:
    """Answer every message on `sock` with `server.handle`, for good; between messages,
    forget expired sessions and those whose client's connection closed."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    swept = time.monotonic()
    while True:
        if poller.poll(200):
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                continue
            peer = frames[0]  # a ROUTER's: the peer's identity, then at least one frame
            fd = _source(peer)
            reply, verified = server.handle(frames[1:], fd)
            if verified is not None and fd is not None:
                guard.verified(fd, verified)
            if reply is not None:
                try:
                    sock.send_multipart([peer, *reply], copy=False)
                except zmq.ZMQError as error:  # the client left: nothing to tell it
                    log.info("could not answer a client that went away: %s", error)
        now = time.monotonic()
        if now - swept > 1.0:
            swept = now
            for fd in guard.gone():
                server.gone(fd)
            server.expire()


def _source(frame: Any) -> int | None:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
