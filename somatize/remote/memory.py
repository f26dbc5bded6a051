"""How this process's C heap treats large buffers, so that a large message lands in memory
that is already mapped.

libzmq receives every message into a buffer it mallocs for it (there is no way to hand it
one), and a tensor is then built on that buffer. glibc serves an allocation above its mmap
threshold (at most 32 MB unless told otherwise) with a fresh `mmap`, and gives it back with
`munmap` when it is freed: every 64 MB message is then 16,384 page faults, which run at
about 0.7 GB/s on a virtual machine, slower than the network stack itself. `keep_buffers()`
raises the threshold and the trim threshold to `LIMIT` and keeps libzmq's threads on the
main heap, so a freed message buffer is reused by the next one (docs/remote.md, "Large
messages").

The worker does this when it starts; a client does it when it opens its first connection
(before ZeroMQ's own threads exist). Set ``SOMATIZE_KEEP_BUFFERS=0`` to leave the C heap as
it is. What it costs: up to `LIMIT` of freed memory may stay mapped in the process instead
of going back to the system at once (it is reused by the next large allocation).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["LIMIT", "keep_buffers"]

LIMIT = 256 << 20
"""Allocations up to this size come from the heap and are reused; above it, `mmap` as before."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_done: bool | None = None


def keep_buffers() -> bool:
    """Tell glibc's malloc to keep freed buffers up to `LIMIT` for reuse (once per process).

    True when the settings took; False where there is no glibc (macOS, musl, Windows), or
    when ``SOMATIZE_KEEP_BUFFERS=0`` asks to leave malloc alone. Never raises.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("SOMATIZE_KEEP_BUFFERS", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has no such symbol)
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, LIMIT) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, LIMIT) == 1 and ok
    # One arena: a thread arena's heap is at most 64 MB, so a large buffer malloc'd by
    # libzmq's I/O thread there would be mmapped whatever the threshold says.
    ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
    _done = ok
    return ok
