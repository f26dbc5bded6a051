"""`python -m somatize.worker --listen HOST:PORT`: a worker that serves slices of graphs.

A thin entry point: the worker itself is `somatize.remote.server`.
"""

from __future__ import annotations

from somatize.remote.server import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
