"""`python -m somatize.worker --listen HOST:PORT`: a worker that holds nodes and runs slices
of graphs (and trainers' stages) for the clients that have its token.

    SOMATIZE_TOKEN=... python -m somatize.worker --listen 0.0.0.0:7000 --import mymodels

The token is read from `--token-file PATH` or `$SOMATIZE_TOKEN` (a `--token` on the command
line works too, and is visible to every local user). `--import MODULE` (again for more) names
the modules whose node classes this worker may build when a client sends a node by name;
`--accept-code` lets trusted clients send nodes as code instead. Ctrl-C stops it at once with
exit code 0. See `docs/remote.md`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import sys
import threading
import time

__all__ = ["main"]

log = logging.getLogger("somatize.worker")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _size(text: str) -> int:
    """Bytes, from `1073741824`, `64MiB`, `64M` or `1GB` (each unit a power of 1024)."""
    found = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not found:
        raise argparse.ArgumentTypeError(f"a size in bytes (say 1073741824 or 1GiB), not {text!r}")
    return int(found.group(1)) * _UNITS[found.group(2).lower()]


def _watch_parent(parent: int) -> None:
    """Stop this process once the process that spawned it is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    log.warning("the process that spawned this worker is gone; stopping")
    os._exit(0)


def _secret(given: str | None, path: str | None, env: str, flag: str) -> str | None:
    """A secret (the token, a CURVE key): `flag`'s value (visible to every local user: said
    in the log), else the first line of the file `path`, else `$env`; None when none."""
    if given:
        log.warning(
            "%s on the command line is visible to every local user: use %s-file", flag, flag
        )
        return given
    if not path:
        return os.environ.get(env) or None
    try:
        with open(path, encoding="utf-8") as f:
            found = f.readline().strip()
    except (OSError, ValueError) as error:
        raise SystemExit(f"{flag}-file: {error}") from None
    if not found:
        raise SystemExit(f"{flag}-file: the file {path} holds no secret on its first line")
    return found


def parser() -> argparse.ArgumentParser:
    """The worker's command line."""
    p = argparse.ArgumentParser(
        prog="python -m somatize.worker", description=__doc__.split("\n")[0]
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any free)")
    p.add_argument("--token-file", help="a file whose first line is the token")
    p.add_argument(
        "--token", help="the token (visible to local users: prefer --token-file or $SOMATIZE_TOKEN)"
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module whose node classes clients may send by name (again for more)",
    )
    p.add_argument(
        "--accept-code",
        action="store_true",
        help="accept nodes sent as code (cloudpickle): only for clients you trust fully",
    )
    p.add_argument(
        "--curve-secret-file", help="a file holding this worker's CURVE secret key (z85): encrypt"
    )
    p.add_argument("--curve-secret", help=argparse.SUPPRESS)
    p.add_argument(
        "--session-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="forget a client's session after this long unused (default 3600)",
    )
    p.add_argument(
        "--max-message",
        type=_size,
        default=1 << 30,
        metavar="BYTES",
        help="refuse a frame larger than this, before reading it, and a message four times as "
        "large (default 1GiB; at least 48, 259 with CURVE)",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=64,
        metavar="N",
        help="connections that have not yet sent a message that verifies (default 64)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="log warnings only")
    p.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    """Serve until stopped (SIGTERM, Ctrl-C, or the parent that spawned it gone)."""
    a = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if a.quiet else logging.INFO,
        stream=sys.stderr,
        format="somatize.worker %(levelname)s %(message)s",
    )
    from somatize.remote.client import endpoint

    try:
        listen = endpoint(a.listen, listen=True)
    except ValueError:
        raise SystemExit(
            f"--listen takes HOST:PORT (or ipc://PATH), the port a number from 0 (any free "
            f"one) to 65535 (say 127.0.0.1:7000), not {a.listen!r}"
        ) from None
    if a.session_timeout <= 0:
        raise SystemExit("--session-timeout is a number of seconds > 0")
    token = _secret(a.token, a.token_file, "SOMATIZE_TOKEN", "--token")
    if not token:
        token = secrets.token_hex(32)
        log.warning("no token given: clients must use SOMATIZE_TOKEN=%s", token)
    curve = _secret(a.curve_secret, a.curve_secret_file, "SOMATIZE_CURVE_SECRET", "--curve-secret")

    import zmq

    from somatize import _hooks
    from somatize.remote.allowed import Allowed
    from somatize.remote.listener import Guard, bind, serve, smallest_message
    from somatize.remote.server import Server

    _hooks.ready(torch_needed=True)  # tensors, devices, stages: a worker without torch is no use
    smallest = smallest_message(bool(curve))
    if a.max_message < smallest:
        what = "CURVE's handshake (its INITIATE command)" if curve else "the smallest request"
        raise SystemExit(
            f"--max-message {a.max_message} is too small: {what} needs {smallest} bytes, or this "
            f"worker drops it unread while its clients wait: give {smallest} or more"
        )
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    try:
        allowed = Allowed(a.imports)
    except ImportError as error:
        raise SystemExit(f"--import: {error}") from None
    server = Server(
        token,
        accept_code=a.accept_code,
        allowed=allowed,
        session_timeout=a.session_timeout,
        max_message=a.max_message,
    )
    context = zmq.Context()
    sock = bind(context, listen, max_message=a.max_message, curve_secret=curve)
    guard = Guard(sock, most_pending=a.max_pending, most_bytes=a.max_message)
    where = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    if a.parent is not None:
        name = "somatize-parent-watch"
        threading.Thread(target=_watch_parent, args=(a.parent,), daemon=True, name=name).start()
    print(
        f"somatize worker ready {where} pid {os.getpid()} session-timeout {a.session_timeout:g}",
        flush=True,
    )
    log.info(
        "serving on %s: sessions expire after %g s unused; frames over %d bytes refused; "
        "builds %s%s",
        where,
        a.session_timeout,
        a.max_message,
        sorted(allowed.versions) or "no imported node classes",
        "; accepts code" if a.accept_code else "",
    )
    try:
        serve(sock, server, guard)
    except KeyboardInterrupt:
        pass
    finally:  # nothing left to wait on: the guard's socket closed, nothing lingers
        guard.close()
        sock.close(0)
        context.term()


if __name__ == "__main__":
    main()
