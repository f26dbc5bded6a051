"""A raw socket to a worker, past its seal: what a token holder who writes their own bytes
holds. The hostile-input tests send through it what no `Broker` would."""

from __future__ import annotations

from typing import Any

import zmq

from somatize.remote import seal


def sealed(worker: Any, timeout_ms: int = 15000) -> tuple[zmq.Socket, seal.Seal]:
    """A DEALER socket connected to `worker` (a `Worker`), and the `Seal` its token and a
    fresh salt make; close the socket with `sock.close(0)`."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(worker.address)
    sock.send(seal.SALT_ASK)
    return sock, seal.Seal(seal.derive(worker.token, sock.recv_multipart()[1]))
