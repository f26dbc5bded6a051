"""Another process, another machine: `Worker`, `Broker`, and the wire between them.

    from somatize import Broker, Worker

    b = Broker.embedded({"gpu": Worker.at("node3:7000")})   # or Worker.spawn() for a child
    y = g.forward(x, broker=b)                                # .at("gpu") nodes run there

A worker is started with ``python -m somatize.worker --listen HOST:PORT`` and a shared token
(``--token-file`` or ``SOMATIZE_TOKEN``). See ``docs/remote.md``.
"""

from __future__ import annotations

from somatize.remote.broker import Broker
from somatize.remote.client import Worker
from somatize.remote.errors import RemoteError, StateLost, Unknown, WorkerLost
from somatize.remote.seal import Refused
from somatize.remote.wire import Malformed

__all__ = [
    "Broker",
    "Malformed",
    "Refused",
    "RemoteError",
    "StateLost",
    "Unknown",
    "Worker",
    "WorkerLost",
]
