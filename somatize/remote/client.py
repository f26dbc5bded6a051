"""`Worker`: where a worker is, how nodes travel to it, and (for a child) the process.

A `Worker` is a declaration: `Worker.at("node3:7000")` opens nothing until work is sent.
`Worker.spawn(...)` and `Worker.generic(...)` start one as a child process of this one (for
tests, demos, notebooks), wait until it is ready, and stop it when it is closed or when this
interpreter exits.

How a node travels is the worker's `mode`:

- `"project"`: its class by module and name, its constructor arguments and its weights; the
  worker builds it from a module it was started to import (`send=[module, ...]` names them:
  a spawned worker is started with `--import` for each, and a standing one must have been);
  the module's version (its `__version__`, or a digest of its file) goes too, and a worker
  with other code refuses the node.
- `"network"`: the class and its arguments go as code (cloudpickle; the modules in `send`
  travel whole, by value), only to a worker started with `--accept-code`.
- left out: `"network"` for a worker that accepts code, `"project"` otherwise.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from somatize.remote.allowed import version_of
from somatize.remote.connection import Connection
from somatize.remote.spawn import Child, command_line

__all__ = ["Worker", "MODES", "endpoint"]

MODES = ("project", "network")
"""How nodes travel to a worker (see the module's doc)."""


def endpoint(address: Any, *, listen: bool = False) -> str:
    """The ZeroMQ endpoint of a worker's address: "host:port" or "tcp://host:port" (a port
    from 1 to 65535, as the worker printed it), or an "ipc://path"; anything else is a
    `ValueError` naming it, when the `Worker` is declared rather than at its first use. With
    `listen` (where a worker listens), port 0 or "*" is any free one."""
    said = (
        f"a worker's address is 'host:port' (or 'tcp://host:port'), the port a number from 1 "
        "to 65535, as the worker prints it ('somatize worker ready tcp://HOST:PORT'), not "
        f"{address!r}"
    )
    if not isinstance(address, str) or not address:
        raise ValueError(said)
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    if scheme == "ipc" and rest:
        return address
    host, _, port = rest.rpartition(":")
    free = listen and port in ("0", "*")  # where a worker listens: any free port
    if scheme != "tcp" or not host or not (free or port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(said)
    return f"tcp://{host}:{'*' if free else int(port)}"


def curve_key(key: Any) -> str:
    """A worker's CURVE public key as a connection takes it: z85 text, 40 characters for 32
    bytes, given as text or as the bytes `zmq.curve_keypair()` makes; else a `ValueError`."""
    from zmq.utils import z85

    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    try:
        if isinstance(text, str) and len(z85.decode(text)) == 32:
            return text
    except (ValueError, KeyError):
        pass
    raise ValueError(
        "server_key is the worker's CURVE public key: 40 characters of z85, the public half "
        f"of the zmq.curve_keypair() whose secret the worker was started with, not {key!r:.60}"
    )


class Worker:
    """Where a worker is: its address, the token to seal with, its CURVE key when it encrypts,
    and how nodes travel to it (`mode`, `send`). Nothing opens until work is sent."""

    connect_within = 10.0
    """Seconds a request waits for a worker nothing answers for before it is `WorkerLost`."""

    def __init__(
        self,
        address: str,
        *,
        mode: str | None = None,
        send: Iterable[Any] = (),
        token: str | None = None,
        server_key: str | None = None,
        deadline: float = 300.0,
    ) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode is 'project' or 'network' (or left out), not {mode!r}")
        self.address = endpoint(address)
        self.mode = mode
        self.send: list[str] = []
        for m in send or ():
            name = m if isinstance(m, str) else getattr(m, "__name__", None)
            if not isinstance(name, str) or not name:
                raise TypeError(f"send= takes modules or module names, not {m!r:.60}")
            self.send.append(name)
        self.token = token
        self.server_key = None if server_key is None else curve_key(server_key)
        self.deadline = float(deadline)
        self.child: Child | None = None

    @classmethod
    def at(
        cls,
        address: str,
        *,
        mode: str | None = None,
        send: Iterable[Any] = (),
        token: str | None = None,
        server_key: str | None = None,
        deadline: float = 300.0,
    ) -> Worker:
        """A worker already standing at `address` ("host:port" or "tcp://host:port").

        `token` defaults to `$SOMATIZE_TOKEN`; `server_key` is the worker's CURVE public key
        (z85) when it encrypts; `deadline` is how long one request may take, in seconds.
        `mode` and `send` say how nodes travel (the module's doc); a worker that cannot take
        them that way is refused at the first connection, saying how to start it.
        """
        return cls(
            address, mode=mode, send=send, token=token, server_key=server_key, deadline=deadline
        )

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str] = (),
        *,
        mode: str | None = None,
        send: Iterable[Any] = (),
        token: str | None = None,
        encrypt: bool = False,
        env: dict[str, str] | None = None,
        ready_within: float = 60.0,
        deadline: float = 300.0,
        quiet: bool = True,
        python: str | None = None,
    ) -> Worker:
        """Start a worker as a child process on 127.0.0.1 and wait until it is ready.

        `argv` is the whole command line when it starts with a program
        (`[sys.executable, "-m", "somatize.worker", ...]`), else extra arguments for
        `python -m somatize.worker` (say `["--threads", "1"]`). Added when missing:
        `--listen 127.0.0.1:0`, `--quiet` (unless `quiet=False`), `--accept-code` for
        `mode="network"`, `--import M` for each module of `send` in `mode="project"`.
        A token is made up unless given and passed in the environment; `encrypt=True` makes
        up CURVE keys too. A child that exits before it is ready is reported at once with its
        exit code and what it printed; one not ready within `ready_within` seconds is stopped
        and reported. It is stopped by `stop()`, by closing a broker that holds it, or when
        this interpreter exits (and stops itself if this process dies without saying so).
        """
        token = token or secrets.token_hex(32)
        # mode and send checked before anything starts; the address (a stand-in here) is the
        # child's once it is ready
        worker = cls("127.0.0.1:1", mode=mode, send=send, token=token, deadline=deadline)
        command = command_line(argv, python=python, quiet=quiet, mode=mode, send=worker.send)
        child_env = dict(os.environ if env is None else env)
        child_env["SOMATIZE_TOKEN"] = token
        paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
        child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if encrypt:
            import zmq

            public, secret = zmq.curve_keypair()
            worker.server_key = public.decode()
            child_env["SOMATIZE_CURVE_SECRET"] = secret.decode()
        worker.child = Child(command, child_env, ready_within)
        worker.address = worker.child.address
        return worker

    generic = spawn
    """`spawn` with no `argv`: `python -m somatize.worker` (this interpreter unless `python`
    names another), with the same keywords."""

    def stop(self) -> None:
        """Stop a spawned worker (and everything in its process group); no-op for `at`."""
        if self.child is not None:
            self.child.stop()

    @property
    def pid(self) -> int | None:
        """The process id of a spawned worker, or None."""
        return self.child.process.pid if self.child is not None else None

    @property
    def process(self) -> Any:
        """The `subprocess.Popen` of a spawned worker, or None."""
        return self.child.process if self.child is not None else None

    def connect(self, host: str) -> Connection:
        """A new connection to this worker, for the host named `host` (used in errors)."""
        token = self.token or os.environ.get("SOMATIZE_TOKEN")
        if not token:
            raise ValueError(
                f"no token for host {host!r} ({self.address}): pass Worker.at(..., token=...) "
                "or set SOMATIZE_TOKEN to the worker's token"
            )
        return Connection(self, host, token)

    def travels(self, hello: dict[str, Any], where: str) -> str:
        """How nodes travel to the worker that said `hello`: `"project"` or `"network"`.
        Refused, saying how to start the worker: code for a worker that does not accept it,
        a module of `send` it does not import, or imports at another version than here."""
        accepts = bool(hello.get("accept_code"))
        mode = self.mode or ("network" if accepts else "project")
        if mode == "network":
            if not accepts:
                raise PermissionError(
                    f"{where}: mode='network' sends nodes as code, and this worker was not "
                    "started with --accept-code: start it so (only for clients you trust), "
                    "or use mode='project' with --import for your modules"
                )
            return mode
        imports = hello.get("imports") or {}
        for name in self.send:
            if name not in imports:
                raise ImportError(
                    f"{where} does not import {name}: start it with --import {name} "
                    f"(python -m somatize.worker --import {name} ...)"
                )
            here = version_of(sys.modules.get(name))
            if here is not None and imports[name] is not None and here != imports[name]:
                raise ImportError(
                    f"{where} imports {name} at {imports[name]}, and here it is {here}: "
                    "install the same code on both"
                )
        return mode

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        spawned = f", pid {self.pid}" if self.child is not None else ""
        return f"Worker({self.address!r}{spawned})"
