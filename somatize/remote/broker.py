"""The broker: which worker each host name lives on, and running a plan across them.

`g.forward(x, broker=b)` hands the plan here. The plan's steps are cut, in the order they run,
into slices of consecutive nodes on the same host: a local slice is run here as the engine
would, a remote one goes to its worker as one request (one round trip, whatever its length),
carrying the values it reads from outside and bringing back only those that are read after it.
A node reaches a worker the first time it is needed: its class (module and qualified name;
as code only to a worker started with ``--accept-code``), its constructor arguments and its
weights. From then on the worker's copy is the one that runs (and, under a trainer's
``trains=``, the one that learns); `state` and `load` read and write it.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Callable
from typing import Any

from somatize import _hooks
from somatize.remote.client import Connection, Worker
from somatize.remote.slices import cut, run_plan

__all__ = ["Broker"]


class Broker:
    """Knows where each host name lives, and sends the `.at(host)` slices of a graph there.

    >>> b = Broker.embedded({"gpu": Worker.at("node3:7000")})   # doctest: +SKIP
    >>> g.forward(x, broker=b)                                   # doctest: +SKIP

    Connections open on first use. `close()` says goodbye to every worker (they forget this
    broker's nodes) and stops those that were spawned.
    """

    def __init__(self, workers: dict[str, Worker]) -> None:
        if not isinstance(workers, dict) or not workers:
            raise ValueError("a Broker takes {host_name: Worker}, with at least one host")
        for host, worker in workers.items():
            if not isinstance(host, str) or not host:
                raise ValueError(f"a host name is a non-empty str, not {host!r}")
            if not isinstance(worker, Worker):
                raise TypeError(
                    f"host {host!r}: a Broker takes Worker.at(...) or Worker.spawn(...), "
                    f"not {type(worker).__name__}"
                )
        self.workers = dict(workers)
        self.session = secrets.token_hex(8)
        self._connections: dict[str, Connection] = {}
        self._defined: dict[str, dict[str, str | None]] = {}
        self._held: dict[str, Any] = {}
        self._slices: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
        self._last: tuple[Any, list] | None = None  # (weak plan, its slices), the last run
        self.closed = False

    @classmethod
    def embedded(cls, workers: dict[str, Worker]) -> Broker:
        """A broker that knows these hosts: `{host_name: Worker}`."""
        return cls(workers)

    # -- connections ------------------------------------------------------------------------
    def worker(self, host: str) -> Worker:
        """The worker a host name lives on; an unknown host is refused, naming the known."""
        found = self.workers.get(host)
        if found is None:
            raise ValueError(
                f"this broker does not know host {host!r}; it knows {sorted(self.workers)}: "
                f"add it with Broker.embedded({{{host!r}: Worker.at('host:port')}})"
            )
        return found

    def connection(self, host: str) -> Connection:
        """The connection to `host`'s worker, opened (and greeted) on first use."""
        if self.closed:
            raise RuntimeError("this broker is closed")
        conn = self._connections.get(host)
        if conn is None:
            conn = self.worker(host).connect(host)
            try:
                conn.hello = conn.request({"op": "hello"}, deadline=conn.worker.connect_within + 5)
            except BaseException:
                conn.close()
                raise
            self._connections[host] = conn
        return conn

    def request(self, host: str, message: dict[str, Any], **kw: Any) -> Any:
        """Send one request (signed, under this broker's session) to `host`'s worker."""
        conn = self._connections.get(host) or self.connection(host)  # none once closed
        answer = conn.request(message, session=self.session, **kw)
        known = self._defined.get(host)
        if known and next(iter(known.values())) != conn.incarnation:
            # A restarted worker holds none of them any more: a new dict, so that a slice
            # that noted the old one (`held`) knows to look again.
            self._defined[host] = {}
        return answer

    def run(self, host: str, sid: str, given: dict, input: Any) -> Any:
        """A repeated forward of slice `sid`, which `host`'s worker holds, nobody watching:
        what `request` gives back for its run request, written straight away as a record
        (`Connection.run`)."""
        conn = self._connections.get(host) or self.connection(host)
        answer = conn.run(self.session, sid, given, input)
        known = self._defined.get(host)
        if known and next(iter(known.values())) != conn.incarnation:
            self._defined[host] = {}  # as `request` does
        return answer

    # -- nodes ------------------------------------------------------------------------------
    def key(self, node: Any) -> str:
        """The name a node goes by on a worker, for this broker."""
        return f"n{id(node):x}"

    def definition(self, host: str, nid: str, node: Any, device: str | None) -> dict | None:
        """What a worker needs to rebuild `node`, or None if it already holds it."""
        key = self.key(node)
        if key in self._defined.get(host, {}):
            return None
        self._held[key] = node
        return definition(node, nid, key, device, self.connection(host), host)

    def holds(self, host: str, key: str) -> bool:
        """Whether `host`'s worker holds `key` (a node, or a slice's compiled steps) as far as
        this broker knows."""
        return key in self._defined.get(host, ())

    def defined(self, host: str, defs: list[dict]) -> None:
        """Note that `host`'s worker now holds these definitions."""
        conn = self._connections[host]
        known = self._defined.setdefault(host, {})
        for d in defs:
            known[d["key"]] = conn.incarnation

    def held(self, host: str) -> Any:
        """What `host`'s worker holds as far as this broker knows, as one object that is
        replaced (never emptied) when the worker lost it: a slice that found all it needs
        there keeps it, and while it is still the one here sends only its id."""
        return self._defined.get(host)

    def forget(self, host: str) -> None:
        """Forget which nodes `host`'s worker holds (it lost them): they are sent again."""
        self._defined.pop(host, None)

    def weights(self, graph: Any, nid: str) -> dict[str, Any]:
        """The weights of node `nid` as its worker holds them, `{key: tensor}` (the keys of
        `Trainer.export`): what a node trained where it runs has learnt."""
        host, node, device = self._where(graph, nid)
        defs = [d for d in [self.definition(host, nid, node, device)] if d]
        got = self.request(host, {"op": "state", "key": self.key(node), "define": defs})
        self.defined(host, defs)
        return got

    def load_weights(self, graph: Any, nid: str, weights: dict[str, Any]) -> None:
        """Send `{key: tensor}` to the copy of node `nid` on its worker (refused whole there
        if a key or a shape differs)."""
        host, node, device = self._where(graph, nid)
        defs = [d for d in [self.definition(host, nid, node, device)] if d]
        message = {"op": "load", "key": self.key(node), "state": weights, "define": defs}
        self.request(host, message)
        self.defined(host, defs)

    def _where(self, graph: Any, nid: str) -> tuple[str, Any, Any]:
        s = graph.setting(nid)
        if not s.host:
            raise ValueError(f"node {nid!r} runs here, not on a host: its weights are here")
        return s.host, graph.implementation(nid), s.device

    # -- running ----------------------------------------------------------------------------
    def forward(
        self,
        plan: Any,
        input: Any = None,
        *,
        store: Any = None,
        watching: list[Callable[[dict], Any]] | None = None,
    ) -> Any:
        """Run `plan` on `input`: local slices here, each remote slice in one round trip."""
        if store is not None and plan.cached:
            raise ValueError(
                "caching (.cached() with store=) is not supported yet in a graph with "
                ".at(host) nodes: run the cached prefix as its own graph, or leave store= out"
            )
        return run_plan(self, plan, input, list(watching or ()))

    def slices(self, plan: Any) -> list:
        """The plan cut into slices (worked out once per plan)."""
        last = self._last
        if last is not None and last[0]() is plan:  # the plan run last time, again
            return last[1]
        known = self._slices.get(plan)
        if known is None:
            known = self._slices[plan] = cut(plan)
        self._last = (weakref.ref(plan), known)
        return known

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> None:
        """Tell each worker to forget this broker's nodes, close, and stop spawned workers."""
        if self.closed:
            return
        for _host, conn in self._connections.items():
            try:
                conn.request({"op": "close", "session": self.session}, deadline=2.0)
            except Exception:
                pass  # a worker that is gone has nothing left to forget
            conn.close()
        self._connections.clear()
        self._held.clear()
        for worker in self.workers.values():
            worker.stop()
        self.closed = True

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Broker(" + ", ".join(f"{h!r}: {w!r}" for h, w in self.workers.items()) + ")"


def definition(
    node: Any, nid: str, key: str, device: str | None, conn: Connection, host: str
) -> dict[str, Any]:
    """How `node` travels: class by name (or as code to a worker that accepts it), its
    constructor arguments, and its weights. Refuses, before sending anything, a class the
    worker could not import and may not be sent as code."""
    from somatize.remote import wire

    cls = type(node)
    args = getattr(node, "_somatize_args", {})
    accepts = bool((conn.hello or {}).get("accept_code"))
    d: dict[str, Any] = {
        "key": key,
        "id": nid,
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "device": device,
        "state": _state(node),
        "pickled": None,
        "args": None,
    }
    local = cls.__module__ == "__main__" or "<locals>" in cls.__qualname__
    try:
        wire.pack(b"", args)
        plain = True
    except Exception:
        plain = False
    if accepts and (local or not plain):
        import cloudpickle

        d["pickled"] = cloudpickle.dumps((cls, args))
        return d
    if local:
        raise TypeError(
            f"node {nid!r} is a {cls.__qualname__} defined in {cls.__module__}, which the "
            f"worker for host {host!r} cannot import: define the class in a module the worker "
            "can import, or start the worker with --accept-code to send it as code"
        )
    if not plain:
        try:
            wire.pack(b"", args, where=f"the constructor arguments of node {nid!r}")
        except Exception as error:
            raise type(error)(
                f"{error}; or start the worker for host {host!r} with --accept-code"
            ) from None
    d["args"] = args
    return d


def _state(node: Any) -> dict[str, Any]:
    return _hooks.state_of(node)
