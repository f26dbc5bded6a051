"""Runs the notebooks in place and saves them with their outputs: how the committed outputs are
made.

    python notebooks/execute.py                 # every notebook
    python notebooks/execute.py 01_tour 02      # those whose name starts so

Each notebook runs top to bottom in a fresh kernel (over local sockets, not TCP), from this
folder, and is written back with its outputs but without the widgets' saved state
(`metadata.widgets`: each widget's whole bundle and data, which JupyterLab redraws from a live
kernel anyway; without it, nbconvert's HTML asks no widget manager of the network). What a
figure shows without a kernel is its static face, an output of its own under the widget's:
the picture as it was when the cell that changed it last ended (a live audit after its fit).
nbval does not compare widget outputs, and `sanitize.cfg` sets the faces aside (their numbers
are a training's, which another CPU rounds otherwise), so the notebooks stay tests. Prints how
long each one took.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook without saved widget state, and with execution timestamps removed (they
    change on every run and say nothing)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def execute(path: Path, *, timeout: int = 300) -> float:
    """Runs one notebook in place; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="somatize-kernel-") as sockets:
        kernel = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "k"))
        NotebookClient(
            nb,
            km=kernel,
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
    took = time.perf_counter() - began
    nbformat.write(strip(nb), path)
    return took


def main(argv: list[str]) -> int:
    """Command line: run the notebooks named (by prefix), or all of them."""
    paths = sorted(HERE.glob("*.ipynb"))
    if argv:
        paths = [p for p in paths if any(p.name.startswith(a) for a in argv)]
        if not paths:
            print(f"no notebook in {HERE} starts with {' or '.join(argv)}")
            return 1
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
