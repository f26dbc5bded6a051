"""somatize: declare a PyTorch network as a graph of nodes; run it, train it, keep what it
produces, and look inside it.

    from somatize import Graph, Node

    g = Graph.somatize(Encoder() >> (Left() | Right()) >> Join())
    y = g.forward(x)

The core here knows nothing of torch; `somatize.torch` brings training and introspection.
"""

from __future__ import annotations

from somatize.codecs import NoCodec, codec, codecs_registered
from somatize.graph import Graph
from somatize.node import Node, Opaque
from somatize.record import Recorder
from somatize.run import Ctx
from somatize.store import Bound, CorruptBinding, CorruptBlob, Store

__version__ = "0.1.0"

__all__ = [
    "Bound",
    "CorruptBinding",
    "CorruptBlob",
    "Ctx",
    "Graph",
    "NoCodec",
    "Node",
    "Opaque",
    "Recorder",
    "Store",
    "codec",
    "codecs_registered",
]


def __getattr__(name: str):
    if name in ("Worker", "Broker"):
        from somatize import remote

        return getattr(remote, name)
    raise AttributeError(f"module 'somatize' has no attribute {name!r}")
