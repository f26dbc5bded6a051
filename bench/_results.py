"""One table per bench in `bench/RESULTS.md`, rewritten by the bench that measured it.

Every bench prints its table as markdown. Run with `--results` (what `make bench` does), it
also replaces its own section of `bench/RESULTS.md` (between `<!-- bench:NAME -->` and
`<!-- /bench:NAME -->`), leaving every other bench's section as it was::

    from _results import report
    report("forward", "Graph.forward against a plain loop", ["graph", "µs/node"], rows)
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("RESULTS.md")
_HEAD = "# Benchmarks\n\nOne table per bench, rewritten by `make bench` (or `python bench/NAME.py --results`).\n"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = [f"Python {platform.python_version()}"]
    if "torch" in sys.modules:
        versions.append(f"torch {sys.modules['torch'].__version__}")
    when = datetime.date.today().isoformat()
    return f"{cpu}, {os.cpu_count()} cores; {', '.join(versions)}; {when}"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; numbers right-aligned, floats to three significant figures."""
    align = [
        "---:" if rows and isinstance(rows[0][i], (int, float)) else "---"
        for i in range(len(header))
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(
    name: str,
    title: str,
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    notes: str = "",
) -> str:
    """Print this bench's table, and with `--results` in `sys.argv` put it in RESULTS.md."""
    body = f"## {name}: {title}\n\n{table(header, rows)}\n\n_{_machine()}_\n"
    if notes:
        body += f"\n{notes.strip()}\n"
    print(body)
    if "--results" in sys.argv:
        _write(name, body)
    return body


def _write(name: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else _HEAD
    section = f"<!-- bench:{name} -->\n{body}<!-- /bench:{name} -->"
    pattern = re.compile(
        rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S
    )
    text = (
        pattern.sub(lambda _: section, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + section + "\n"
    )
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(RESULTS)
