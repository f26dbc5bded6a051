"""A worker as a child process: started, waited for until it says it is ready, and stopped.

The child runs in its own process group, with this interpreter's import path and the token in
its environment (never on its command line), and stops itself when this process dies. What it
prints is passed on and its last lines kept, for the error when it exits before it is ready.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

__all__ = ["Child", "command_line"]

_children: set[Child] = set()
_READY = "somatize worker ready "


def command_line(
    argv: Sequence[str], *, python: str | None, quiet: bool, mode: str | None, send: list[str]
) -> list[str]:
    """The whole command line: `argv` itself when it starts with a program (not with `-`),
    else `python -m somatize.worker` with `argv` as extra arguments; then what is missing of
    `--listen 127.0.0.1:0`, `--parent`, `--quiet`, `--accept-code` (for `mode="network"`) and
    `--import MODULE` for each of `send` (unless the worker takes code and `mode` is not
    `"project"`)."""
    argv = [str(a) for a in argv]
    if argv and not argv[0].startswith("-"):
        command = argv
    else:
        command = [python or sys.executable, "-m", "somatize.worker", *argv]
    if "--listen" not in command:
        command += ["--listen", "127.0.0.1:0"]
    if "--parent" not in command:
        command += ["--parent", str(os.getpid())]
    if quiet and "--quiet" not in command:
        command.append("--quiet")
    if mode == "network" and "--accept-code" not in command:
        command.append("--accept-code")
    if mode == "project" or "--accept-code" not in command:
        said = {command[i + 1] for i, a in enumerate(command[:-1]) if a == "--import"}
        for name in send:
            if name not in said:
                command += ["--import", name]
    return command


class Child:
    """A spawned worker process: `address` once it is ready, `printed` the last lines it
    printed, stopped by `stop()`."""

    def __init__(self, command: list[str], env: dict[str, str], ready_within: float) -> None:
        self.printed: collections.deque[str] = collections.deque(maxlen=40)
        self.address: str | None = None
        self._ready = threading.Event()  # set by its ready line, or by the end of its output
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._passing = threading.Thread(target=self._pass_on, daemon=True, name="somatize-child")
        self._passing.start()
        _children.add(self)
        if not self._ready.wait(ready_within) or self.address is None:
            if self._ready.is_set():  # its output ended: it is on its way out
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5.0)
            code = self.process.poll()
            self.stop()
            self._passing.join(1.0)
            printed = "\n".join(self.printed).strip() or "nothing"
            why = (
                f"exited with code {code} before it was ready"
                if code is not None
                else f"was not ready within {ready_within:.0f} s"
            )
            raise RuntimeError(f"the worker ({' '.join(command)}) {why}; it said:\n{printed}")

    def _pass_on(self) -> None:
        """What it prints, line by line, to this process's stderr, the last lines kept; its
        ready line gives its address instead."""
        stream = self.process.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if self.address is None and line.startswith(_READY):
                self.address = line.split()[3]
                self._ready.set()
                continue
            self.printed.append(line)
            with contextlib.suppress(OSError):
                os.write(2, raw)
        stream.close()
        self._ready.set()

    def stop(self) -> None:
        """Stop the child and everything in its process group (SIGTERM, then SIGKILL)."""
        _children.discard(self)
        process = self.process
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            process.terminate()
        try:
            process.wait(3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(3)


@atexit.register
def _stop_all() -> None:
    for child in list(_children):
        child.stop()
