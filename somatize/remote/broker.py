"""The broker: which worker each host name lives on, what it holds, and running a plan there.

A node reaches a worker the first time it is needed (`Worker`'s mode says how), with its
weights; from then on the worker's copy is the one that runs and learns. A worker that was
restarted, or forgot this broker's session, holds none of it any more: a node that had learnt
nothing there since its weights were last read back or sent is sent again from the copy here;
one that had is `StateLost`, so training never goes on silently from older weights.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import weakref
from collections.abc import Callable
from typing import Any

from somatize import _hooks
from somatize.codecs import NoCodec
from somatize.node import Wrapped, kind_name, note
from somatize.remote import ahead, wire
from somatize.remote.allowed import version_of
from somatize.remote.client import Worker
from somatize.remote.connection import Connection
from somatize.remote.errors import StateLost, Unknown, WorkerLost
from somatize.remote.slices import cut, run_plan
from somatize.run import warn

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
        self._defined: dict[str, set[str]] = {}  # host: the keys its worker holds
        self._incarnation: dict[str, str | None] = {}  # host: its worker's when they were sent
        # key: (node id, node, what reads its modes here); kept so that no id is reused
        self._held: dict[str, tuple[str, Any, Callable[[], Any] | None]] = {}
        self._learnt: set[tuple[str, str]] = set()  # (host, key) learnt since last read
        self._lost: dict[str, str] = {}  # key: host, for what a worker lost after learning
        self._told: dict[tuple[str, str], Any] = {}  # (host, key): the modes its copy has
        self._built: dict[tuple[str, str], tuple[list, list]] = {}  # (host, key): (params, dtypes)
        self._slices: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
        self.closed = False

    @classmethod
    def embedded(cls, workers: dict[str, Worker]) -> Broker:
        """A broker that knows these hosts: `{host_name: Worker}`."""
        return cls(workers)

    # -- connections --------------------------------------------------------------------------
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
            worker = self.worker(host)
            for attempt in (0, 1):  # a connection cut while it was being made: once more
                conn = worker.connect(host)
                try:
                    conn.hello = conn.request({"op": "hello"}, deadline=worker.connect_within + 5)
                    conn.mode = worker.travels(conn.hello, conn.where())
                    break
                except BaseException as error:
                    conn.close()
                    # once more only for a connection cut on the way: one never reached
                    # would make the caller wait for nothing twice
                    if attempt or not isinstance(error, WorkerLost) or not conn.reached:
                        raise
            self._connections[host] = conn
        return conn

    def request(self, host: str, message: dict[str, Any], **kw: Any) -> Any:
        """Send one request (sealed, under this broker's session) to `host`'s worker."""
        conn = self.connection(host)
        try:
            return conn.request(message, session=self.session, **kw)
        except Unknown:
            self.forget(host)
            raise
        except WorkerLost as error:
            if behind := self._behind(host):
                note(
                    error,
                    f"node(s) {behind} had learnt there since their weights were last read "
                    "back (Trainer.export): if that worker does not come back, it is lost, and "
                    "the copies here hold what was last read back or sent. Resume with "
                    "Trainer.load(weights) from weights you kept",
                )
            raise
        finally:
            if self._incarnation.get(host, conn.incarnation) != conn.incarnation:
                self.forget(host)  # a restarted worker holds none of it any more

    # -- nodes --------------------------------------------------------------------------------
    def key(self, node: Any) -> str:
        """The name a node goes by on a worker, for this broker."""
        return f"n{id(node):x}"

    def definition(self, host: str, nid: str, node: Any, device: str | None) -> dict | None:
        """What a worker needs to build `node`, or None if it holds it already. A node whose
        learnt weights that worker lost is `StateLost` (see the module's doc)."""
        key = self.key(node)
        if key in self._defined.get(host, ()):
            return None
        if key in self._lost:
            exported: dict[str, dict] = {}  # keyed as Trainer.export keys them: a Learning
            for k, (n, held, _) in self._held.items():  # is held as '<node>/learning', and what
                if self._lost.get(k) == host:  # it brought is exported under 'learning/<key>'
                    node_id, _, part = n.partition("/")
                    state = _hooks.state_of(held)
                    said = {f"{part}/{name}": v for name, v in state.items()} if part else state
                    exported.setdefault(node_id, {}).update(said)
            nodes = sorted(exported)
            raise StateLost(
                f"the worker for host {host!r} was restarted (or forgot this client's session) "
                f"after node(s) {nodes} had learnt there, and what they learnt since their "
                "weights were last read back (Trainer.export) is lost; nothing was trained from "
                "older weights. Resume with Trainer.load(weights) from weights you kept, or "
                "Trainer.load(error.exported) from the last ones this client read back",
                nodes,
                exported,
            )
        ahead.refuse_behind(nid, node, self.session)
        conn = self.connection(host)
        self._held[key] = (nid, node, _hooks.modes(node))
        self._told.pop((host, key), None)  # the copy built there is told its modes after
        params = ahead.params(node)
        self._built[(host, key)] = (params, [p.dtype for p in params])
        return describe(node, nid, key, device, conn)

    def send(self, host: str, nodes: list[tuple], message: dict, kept: tuple = (None, None)) -> Any:
        """Send `message` to `host`'s worker with the definitions of those of `nodes` (each
        `(nid, node, device)`) it does not hold yet, noted as held once it answers. `kept` is
        `(key, describe)` for what the worker keeps under `key` (a forward slice, a trainer's
        stage part): `describe()` goes along as `"described"` while it does not hold it. A
        worker that answers `Unknown` (restarted, or its session expired) is sent again, once,
        what it needs. The modules' train/eval modes go along for the nodes whose modes
        changed since that worker was last told (`model.eval()` here reaches its copy there),
        and a node whose dtypes changed here (`.double()`) is built there anew. Definitions
        sent as code go in a request of their own first, so that the worker has imported what
        their code imports (transformers, a model's module) before it reads the message."""
        key, describe = kept
        for nid, node, _ in nodes:
            self._recast(host, nid, node)
        for attempt in (0, 1):
            defs = [d for n, node, device in nodes if (d := self.definition(host, n, node, device))]
            modes = self._changed(host, nodes)
            sent, held = {**message, "define": defs, "modes": modes}, [d["key"] for d in defs]
            if key is not None:
                sent.update(kept=key, described=None if self.holds(host, key) else describe())
                held.append(key)
            try:
                if any("code" in d for d in defs):  # built before the message is read: its
                    # values may be of classes their code imports (a model's own output)
                    self.request(host, {"op": "define", "define": defs})
                    self.defined(host, [d["key"] for d in defs])
                    sent["define"] = []
                got = self.request(host, sent)
            except Unknown:
                if attempt:
                    raise
                continue
            self.defined(host, held)
            self._told.update(((host, k), said) for k, said in modes.items())
            return got

    def _recast(self, host: str, nid: str, node: Any) -> None:
        """A node whose dtypes changed here since its copy was built on `host`'s worker
        (`.double()`, `.to(dtype)`) is built there anew, with its Learning (held as
        '<node>/learning'); what they learnt there is read back first, and what the worker
        kept built on its nodes is described again."""
        key = self.key(node)
        params, dtypes = self._built.get((host, key), ((), []))
        if [p.dtype for p in params] == dtypes or not self.holds(host, key):
            return
        again = {key} | {k for k, (n, *_) in self._held.items() if n.startswith(f"{nid}/")}
        for k in sorted(again):
            if (host, k) in self._learnt:
                got = self.request(host, {"op": "state", "key": k})
                _hooks.stage_state(self._held[k][1], got)()
                self._learnt.discard((host, k))
                ahead.unmark(self._held[k][1])  # as `read` does: the copy here is current
        known = self._defined[host]  # a node replaced there drops what was built on it
        self._defined[host] = {k for k in known if k in self._held and k not in again}

    def _changed(self, host: str, nodes: list[tuple]) -> dict[str, Any]:
        """`{key: modes}` of those of `nodes` whose modes `host`'s worker was not told yet."""
        changed = {}
        for _, node, _ in nodes:
            read = self._held[key := self.key(node)][2]
            if read is not None and self._told.get((host, key)) != (modes := read()):
                changed[key] = modes
        return changed

    def portable(self, host: str, value: Any) -> Any:
        """`value` as it travels to `host`'s worker beside a node (a Learning's objective): as
        code, `{"code": ...}` written as a node's is (`describe`), to a worker that takes code;
        else as it is, where a class or function goes by name."""
        conn = self.connection(host)
        return {"code": as_code(value, conn)} if conn.mode == "network" else value

    def holds(self, host: str, key: str) -> bool:
        """Whether `host`'s worker holds `key` (a node, a slice, or a trainer's stage part) as
        far as this broker knows."""
        return key in self._defined.get(host, ())

    def defined(self, host: str, keys: list[str]) -> None:
        """Note that `host`'s worker now holds what goes by these keys."""
        self._defined.setdefault(host, set()).update(keys)
        self._incarnation[host] = self._connections[host].incarnation

    def learnt(self, host: str, nodes: list[tuple]) -> None:
        """Note that these nodes (each `(nid, node, device)`, as `send` takes them) may have
        learnt on `host`'s worker (a trainer's step ran there), so that losing them is
        `StateLost`, not a silent restart from older weights."""
        for nid, node, _ in nodes:
            key = self.key(node)
            if "/" in nid:  # a Learning: what it built there (a guesser), its optimizer's state
                self._learnt.add((host, key))
            elif (host, key) not in self._learnt and _learns(node):  # a frozen one learns nothing
                self._learnt.add((host, key))
                ahead.mark(nid, node, self.session, host)

    def resume(self, node: Any) -> None:
        """Go on from the copy here of `node` (what was last read back or sent) on a worker
        that lost what it learnt: it is no longer `StateLost`."""
        self._lost.pop(self.key(node), None)

    def forget(self, host: str) -> None:
        """`host`'s worker holds nothing of this broker's any more (it was restarted, or the
        session expired): what had learnt there is lost, the rest is sent again."""
        for key in self._defined.pop(host, ()):
            if (host, key) in self._learnt:
                self._learnt.discard((host, key))
                self._lost[key] = host

    def weights(self, graph: Any, nid: str) -> dict[str, Any]:
        """The weights of node `nid` as its worker holds them, `{key: tensor}` (the keys of
        `Trainer.export`); the copy here is brought up to them too."""
        return self.read(*self.placement(graph, nid))

    def read(self, host: str, nid: str, node: Any, device: Any = None) -> dict[str, Any]:
        """The weights of `node` (a node, or a Learning) as `host`'s worker holds them, sent
        there first if it does not; the copy here is brought up to them."""
        key = self.key(node)
        got = self.send(host, [(nid, node, device)], {"op": "state", "key": key})
        _hooks.stage_state(node, got)()
        self._learnt.discard((host, key))
        ahead.unmark(node)
        return got

    def write(self, entries: list[tuple], *, then: Callable[[], Any]) -> None:
        """Load `(host, nid, node, device, state)` entries on their workers, all or nothing:
        staged on every worker first (each checks them against its copy), committed when all
        are; `then` (what changes here) runs after; if anything fails, what was committed is
        put back and nothing has changed."""
        lid = secrets.token_hex(6)
        hosts: list[str] = []
        committed: list[str] = []
        lost = dict(self._lost)
        # the caller says where to resume from: no longer behind, unless this fails
        marks = [ahead.unmark(node) for _, _, node, _, _ in entries]
        try:
            for host, nid, node, device, state in entries:
                key = self.key(node)
                self._lost.pop(key, None)
                defs = [d for d in [self.definition(host, nid, node, device)] if d]
                message = {"op": "load", "phase": "stage", "load": lid, "key": key}
                self.request(host, {**message, "state": state, "define": defs})
                self.defined(host, [d["key"] for d in defs])
                if host not in hosts:
                    hosts.append(host)
            for host in hosts:
                self.request(host, {"op": "load", "phase": "commit", "load": lid})
                committed.append(host)
            then()
        except BaseException:  # what was committed is put back, what was staged dropped
            self._lost.update(lost)  # what it popped; what a restart it met lost stays lost
            ahead.remark([m for each in marks for m in each])
            self._each(committed, lid, "undo")
            self._each([h for h in hosts if h not in committed], lid, "drop")
            raise
        self._each(hosts, lid, "drop")
        for (host, _, node, _, state), each in zip(entries, marks, strict=True):
            # the copy here is current only if every key of it (as loaded) was given
            if set(state) >= set(_hooks.state_of(node)):
                self._learnt.discard((host, self.key(node)))
            else:
                ahead.remark(each)

    def _each(self, hosts: list[str], lid: str, phase: str) -> None:
        for host in hosts:
            with contextlib.suppress(Exception):  # a worker that is gone holds nothing
                self.request(host, {"op": "load", "phase": phase, "load": lid}, deadline=10.0)

    def placement(self, graph: Any, nid: str) -> tuple[str, str, Any, Any]:
        """`(host, nid, node, device)` of a node that runs on a host: the head of an entry of
        `write`. A node that runs here is refused (its weights are here)."""
        s = graph.setting(nid)
        if not s.host:
            raise ValueError(f"node {nid!r} runs here, not on a host: its weights are here")
        return s.host, nid, graph.implementation(nid), s.device

    # -- running ------------------------------------------------------------------------------
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
        """The plan cut into forward slices (worked out once per plan)."""
        known = self._slices.get(plan)
        if known is None:
            known = self._slices[plan] = cut(plan)
        return known

    # -- the end ------------------------------------------------------------------------------
    def _behind(self, host: str | None = None) -> list[str]:
        """The ids of the nodes that learnt on `host`'s worker (any, for None) since their
        weights were last read back: the copies here are behind them."""
        keys = {k for h, k in self._learnt if host in (None, h)}
        return sorted({self._held[k][0].partition("/")[0] for k in keys if k in self._held})

    def close(self) -> None:
        """Tell each worker to forget this broker's nodes, close, and stop spawned workers.
        Nodes that learnt on a worker since their weights were last read back
        (`Trainer.export`) lose it: a `RuntimeWarning` names them, and another broker refuses
        to send them on from their copies here (`StateLost`)."""
        if self.closed:
            return
        if behind := self._behind():
            warn(
                f"closing the broker: node(s) {behind} learnt on a worker since their weights "
                "were last read back, and the worker forgets them now: what they learnt is "
                "lost, and the copies here hold what was last read back or sent. Read it back "
                "before closing (Trainer.export) to keep it",
                RuntimeWarning,
            )
        for conn in self._connections.values():
            with contextlib.suppress(Exception):  # a worker that is gone has nothing to forget
                conn.request({"op": "close", "session": self.session}, deadline=2.0)
            conn.close()
        self._connections.clear()
        self._held.clear()
        self._told.clear()
        self._built.clear()
        for worker in self.workers.values():
            worker.stop()
        self.closed = True

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Broker(" + ", ".join(f"{h!r}: {w!r}" for h, w in self.workers.items()) + ")"


def _learns(node: Any) -> bool:
    """Whether a step can change `node`'s state: a parameter that gets a gradient, or a
    module in train mode holding buffers (a BatchNorm's running statistics)."""
    if _hooks.trainable(node):
        return True
    modules = _hooks.state_modules(node)
    return any(m.training and next(m.buffers(recurse=False), None) is not None for m in modules)


def describe(node: Any, nid: str, key: str, device: Any, conn: Connection) -> dict[str, Any]:
    """How `node` travels to `conn`'s worker (its `mode`): its class by name (from a module the
    worker imports) or as code, its constructor arguments and its weights. Refused before
    anything is sent: a class the worker could not build, arguments no codec writes down."""
    cls, host = type(node), conn.host
    args = getattr(node, "_somatize_args", {})
    d = {"key": key, "id": nid, "device": device, "state": _hooks.state_of(node)}
    if conn.mode == "network":
        d["code"] = as_code((cls, args), conn)
        return d
    if isinstance(node, Wrapped):
        raise TypeError(
            f"node {nid!r} is a {kind_name(node)} as it is (Node.of), and a module's make-up "
            "travels only as code: send it as code (mode='network', to a worker for host "
            f"{host!r} started with --accept-code), or write it as a Node class in a module "
            "the worker imports, built from plain constructor arguments"
        )
    module = cls.__module__
    if module == "__main__" or "<locals>" in cls.__qualname__:
        raise TypeError(
            f"node {nid!r} is a {cls.__qualname__} defined in {module}, which no worker can "
            f"import: define it in a module the worker for host {host!r} imports, or send it "
            "as code (mode='network', to a worker started with --accept-code)"
        )
    imports = (conn.hello or {}).get("imports") or {}
    if module not in imports and not module.startswith("somatize."):
        raise PermissionError(
            f"node {nid!r} is a {cls.__qualname__} from {module}, which the worker for host "
            f"{host!r} was not started to import: start it with --import {module} "
            f"(Worker.spawn(..., send=[{module!r}])), or send it as code (mode='network', to "
            "a worker started with --accept-code)"
        )
    try:
        wire.encode(args, where=f"the constructor arguments of node {nid!r}")
    except NoCodec as error:
        raise NoCodec(
            f"{error}; or send it as code (mode='network', to a worker for host {host!r} "
            "started with --accept-code)"
        ) from None
    version = version_of(sys.modules.get(module))
    d.update(module=module, qualname=cls.__qualname__, args=args, version=version)
    return d


def as_code(value: Any, conn: Connection) -> bytes:
    """`value` written as code for `conn`'s worker, the code of the modules it was told to
    take along (`Worker(..., send=)`) by value (`somatize.remote.code`)."""
    from somatize.remote import code  # cloudpickle, imported when code is first sent

    return code.as_code(value, conn.worker.send)
