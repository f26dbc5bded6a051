"""The child processes that the store's fault tests and `bench/store.py --faults` start (and
stop by pid): a writer that keeps a value over and over, a claimer stuck mid-claim, and a
decoder fed over a pipe. Run as `python -c SCRIPT args...`. And `in_a_kernel`, which runs
cells in a real Jupyter kernel."""

from __future__ import annotations

import textwrap

import msgpack

# argv: where, payload bytes. Prints "ready", then keeps {"i": i, "payload": i % 256 repeated,
# "by": its pid} under "big" until it is killed (every value new bytes, so a blob is written).
WRITER = textwrap.dedent(
    """
    import os, sys
    from somatize.store import Store
    store, size = Store(sys.argv[1]), int(sys.argv[2])
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        store.keep("big", {"i": i, "payload": bytes([i % 256]) * size, "by": os.getpid()})
    """
)

# argv: where, name. On a filesystem without hard links (os.link fails), it claims `name`
# and stops between deciding that it won and moving its binding into place: its rename
# prints "claiming" and blocks until the process is killed.
STUCK_CLAIMER = textwrap.dedent(
    """
    import errno, os, sys, time
    from somatize.store import Store
    store = Store(sys.argv[1])
    key = store.put(b"stuck")

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "this filesystem has no hard links")

    def stuck(*args, **kwargs):
        print("claiming", flush=True)
        time.sleep(600)

    os.link, os.replace = no_links, stuck
    store.claim(sys.argv[2], key)
    """
)

# Reads length-prefixed byte strings on stdin; answers one line each: "ok <type>", or
# "refused <exception class> <message>". Anything else escaping (or a crash) ends it.
DECODER = textwrap.dedent(
    """
    import struct, sys
    from somatize.codecs import Malformed, NoCodec, decode
    out = sys.stdout
    while True:
        head = sys.stdin.buffer.read(4)
        if len(head) < 4:
            break
        data = sys.stdin.buffer.read(struct.unpack(">I", head)[0])
        try:
            value = decode(data)
            answer = "ok " + type(value).__name__
        except (Malformed, NoCodec) as error:
            answer = "refused " + type(error).__name__ + " " + str(error).replace("\\n", " ")
        out.write(answer + "\\n")
        out.flush()
    """
)


def tuples(depth: int) -> bytes:
    """The bytes of `()` nested `depth` deep, built directly (encode refuses past DEPTH):
    195 deep is the 900-byte value that overflowed the C stack of the old decoder."""
    data = msgpack.packb(None)
    for _ in range(depth):
        data = msgpack.packb(msgpack.ExtType(1, b"\x91" + data))
    return data


def in_a_kernel(cells: list[str], path) -> list:
    """Run `cells` as a notebook in a real python3 kernel working in `path`; its cells, with
    their outputs."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path)}}
    ).execute()
    return nb.cells
