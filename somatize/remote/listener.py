"""The worker's socket: limits applied before a message is read, a guard on its connections,
and the loop that hands each message to the `Server`.

ZeroMQ refuses a frame larger than `max_message` when its size is announced, queues at most
`QUEUED` messages per connection, and holds a message's frames until its last one has come.
So the `Guard` cuts connections that have not sent a message that verifies (strangers), the
way docs/remote.md ("Limits before a message is read") says, and clients whose message never
ends; out of descriptors, it cuts the stranger waiting longest, never spun on.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import resource
import socket
import struct
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from somatize.remote import seal, wire

__all__ = ["QUEUED", "PENDING_WITHIN", "Guard", "bind", "serve", "smallest_message"]

log = logging.getLogger("somatize.worker")

QUEUED = 2
"""Messages a connection may have waiting while the worker is busy with another."""

PENDING_WITHIN = 10.0
"""Seconds a connection may stay open without sending a message that verifies."""

_BOXED = 33
"""The bytes CURVE adds to each frame (a MESSAGE command: its name, a nonce, a MAC, flags),
which libzmq weighs with the frame: a worker that encrypts allows for them."""

_INITIATE = 292
"""The bytes of the INITIATE command a DEALER sends in CURVE's handshake, which libzmq weighs
as it weighs a frame (113 + 128 + 16 + its 35 bytes of properties)."""

_QUIET = 1 << 20  # bytes strangers may send together without being weighed (hellos, salts)

_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_MONITOR_STOPPED
)


def smallest_message(curve: bool) -> int:
    """The smallest `max_message` with which a worker answers a client: every frame of the
    smallest request a broker sends (a close: its seal, and its header with a 64-bit rid and
    a 16-character session) fits, and with CURVE (`curve`) the handshake's INITIATE too."""
    request = wire.encode({"op": "close", "rid": (1 << 64) - 1, "session": "0" * 16})
    frames = seal.Seal(bytes(32)).seal(request)
    return max(_INITIATE - _BOXED if curve else 0, *(memoryview(f).nbytes for f in frames))


def bind(context: zmq.Context, endpoint: str, *, max_message: int, curve_secret: str | None):
    """The worker's ROUTER socket, bound to `endpoint`, with its limits set first."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message) + (_BOXED if curve_secret else 0))
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


@contextlib.contextmanager
def _borrowed(fd: int):
    """Descriptor `fd` as a socket, without a new descriptor (which matters when they have run
    out); it stays libzmq's."""
    s = socket.socket(fileno=fd)
    try:
        yield s
    finally:
        s.detach()


def _received(fd: int) -> int:
    """The bytes that TCP connection `fd` has received (Linux's tcp_info), 0 where unknown."""
    try:
        with _borrowed(fd) as s:
            info = s.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", -1), 256)
    except OSError:
        return 0
    return struct.unpack_from("=Q", info, 128)[0] if len(info) >= 136 else 0  # bytes_received


def _resident() -> int | None:
    """The memory this process holds (Linux's /proc), None where unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def _cut(fd: int) -> None:
    """End the TCP connection on descriptor `fd` (libzmq sees the end and closes it)."""
    with contextlib.suppress(OSError), _borrowed(fd) as s:
        s.shutdown(socket.SHUT_RDWR)


class Guard:
    """Watches the connections of `sock` on a thread of its own (see the module's doc)."""

    def __init__(self, sock: zmq.Socket, *, most_pending: int, most_bytes: int) -> None:
        self.sock = sock
        self.most_pending = max(1, min(int(most_pending), _spare_descriptors() // 2))
        self.most_bytes = most_bytes
        self.rest = _resident()  # this process's memory while strangers send next to nothing
        self.lock = threading.Lock()
        self.pending: dict[int, float] = {}  # descriptor: when it was accepted
        self.proven: dict[int, int] = {}  # a client's descriptor: bytes sent when last answered
        self.open: dict[int, int] = {}  # descriptor: the number of the connection on it
        self.closed: list[int] = []  # the numbers of the connections closed since last asked
        self._numbers = itertools.count()
        self._told = -float("inf")
        self.monitor = sock.get_monitor_socket(_EVENTS)
        # the loop asks (`connection`) and this thread answers once it has read every event
        where = f"inproc://somatize-guard-{id(self)}"
        self._answers = sock.context.socket(zmq.PAIR)
        self._answers.bind(where)
        self._asks = sock.context.socket(zmq.PAIR)
        self._asks.setsockopt(zmq.LINGER, 0)
        self._asks.setsockopt(zmq.RCVTIMEO, 1000)
        self._asks.setsockopt(zmq.SNDTIMEO, 1000)
        self._asks.connect(where)
        self.thread = threading.Thread(target=self._watch, daemon=True, name="somatize-guard")
        self.thread.start()

    def verified(self, fd: int, ok: bool) -> None:
        """A message from `fd` verified (`ok`: it is a client's) or did not (a stranger's is
        cut a second from now, time for the refusal to reach it)."""
        sent = _received(fd) if ok else 0
        with self.lock:
            if ok:
                self.pending.pop(fd, None)
                self.proven[fd] = sent
            elif fd in self.pending:
                self.pending[fd] = min(self.pending[fd], time.monotonic() - PENDING_WITHIN + 1)

    def connection(self, fd: int | None) -> int | None:
        """The number of the connection on descriptor `fd` now, None where unknown: a number
        is never reused, a descriptor is. Asked for a message just received, once this thread
        has read every event so far, its connection's opening among them (libzmq says a
        connection closed before its descriptor can be reused)."""
        if fd is None:
            return None
        with contextlib.suppress(zmq.ZMQError):
            while self._asks.poll(0):  # the answer to an ask given up on
                self._asks.recv()
            self._asks.send(b"")
            self._asks.recv()
        with self.lock:
            return self.open.get(fd)

    def gone(self) -> list[int]:
        """The numbers of the connections closed since the last call."""
        with self.lock:
            found, self.closed = self.closed, []
        return found

    def close(self, within: float = 2.0) -> None:
        """Stop watching: the thread ends (within `within` seconds) and closes its sockets, or
        does so when the context is terminated, so that terminating it never waits on it."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.thread.join(within)
        self._asks.close(0)

    def _watch(self) -> None:
        monitor, answers = self.monitor, self._answers
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(answers, zmq.POLLIN)
        try:
            while True:
                watched = self.pending or self.proven  # looked at often: what they send
                ready = dict(poller.poll(25 if watched else 250))
                while monitor.poll(0):  # every event so far, before an answer
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                        return
                    self._event(event["event"], event["value"])
                if answers in ready:
                    answers.recv()
                    answers.send(b"")
                self._sweep()
        except zmq.ZMQError:  # the context was terminated first
            pass
        finally:
            monitor.close(0)
            answers.close(0)

    def _event(self, kind: int, fd: int) -> None:
        cut = None
        with self.lock:
            if kind == zmq.EVENT_ACCEPTED:
                if len(self.pending) >= self.most_pending:
                    cut = self._longest()  # so that a client that has just connected gets in
                self.pending[fd] = time.monotonic()
                self.open[fd] = next(self._numbers)
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self.pending.pop(fd, None)
                self.proven.pop(fd, None)
                if (number := self.open.pop(fd, None)) is not None:
                    self.closed.append(number)
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
        fd = min(self.pending, key=self.pending.__getitem__, default=None)
        self.pending.pop(fd, None)
        return fd

    def _sweep(self) -> None:
        now = time.monotonic()
        with self.lock:
            old = [fd for fd, at in self.pending.items() if now - at > PENDING_WITHIN]
            for fd in old:
                del self.pending[fd]
            strangers = list(self.pending)
            clients = dict(self.proven)
        for fd in old + self._heaviest(strangers) + self._endless(clients):
            _cut(fd)

    def _endless(self, clients: dict[int, int]) -> list[int]:
        """Those of `clients` that sent more since their last answer than the messages a
        connection may have waiting can hold (`wire.MOST_MESSAGE` times `most_bytes` each),
        taken off the proven (to be cut)."""
        most = QUEUED * wire.MOST_MESSAGE * self.most_bytes + _QUIET
        over = [fd for fd, base in clients.items() if _received(fd) - base > most]
        if over:
            log.warning(
                "cut %d client(s) that sent over %d bytes without a message ending: a message "
                "is at most %d bytes (four times --max-message)",
                len(over),
                most,
                wire.MOST_MESSAGE * self.most_bytes,
            )
        with self.lock:
            return [fd for fd in over if self.proven.pop(fd, None) is not None]

    def _heaviest(self, strangers: list[int]) -> list[int]:
        """Those of `strangers` that sent most, taken off the pending (to be cut), while they
        have sent more than `most_bytes` together, or this process holds `most_bytes` more
        than when they had sent next to nothing (ZeroMQ keeps a frame in 64 bytes or more:
        empty frames take 32 times what they cost to send)."""
        sent = {fd: _received(fd) for fd in strangers}
        held = _resident()
        if sum(sent.values()) <= _QUIET:  # the worker's own memory, as it is at rest
            self.rest = held
            return []
        over = sum(sent.values()) - self.most_bytes
        grown = held - self.rest - self.most_bytes if held and self.rest else 0
        heaviest = []
        for fd in sorted(sent, key=sent.__getitem__, reverse=True):
            if over <= 0 and grown <= 0:
                break
            over -= sent[fd]
            grown -= 32 * sent[fd]  # at most; what it held is seen going at the next look
            heaviest.append(fd)
        with self.lock:  # not one that verified meanwhile
            return [fd for fd in heaviest if self.pending.pop(fd, None) is not None]


def serve(sock: zmq.Socket, server: Any, guard: Guard) -> None:
    """Answer every message on `sock` with `server.handle`, for good; between messages,
    forget expired sessions and those whose client's connection closed. A connection is
    named by its peer's identity (the ROUTER's, never reused), mapped to the number the guard
    gave it."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    peers: dict[bytes, int] = {}  # a peer's identity: the number of its connection
    swept = time.monotonic()
    while True:
        if poller.poll(200):
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                continue
            peer = frames[0]  # a ROUTER's: the peer's identity, then at least one frame
            fd = _source(peer)
            who = peer.bytes
            if who not in peers and (number := guard.connection(fd)) is not None:
                peers[who] = number
            try:
                reply, verified = server.handle(frames[1:], who)
            except Exception:  # a bug answering it: this message goes unanswered, not the rest
                log.exception("could not answer a message")
                continue
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
            closed = set(guard.gone())
            for who in [who for who, number in peers.items() if number in closed]:
                del peers[who]
                server.gone(who)
            server.expire()


def _source(frame: Any) -> int | None:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
