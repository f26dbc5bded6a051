"""The arrows of DESIGN.md point one way: the core never imports torch, figures or Jupyter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from test_hooks import CORE, PACKAGE  # the core: one list of its modules


def top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for stmt in tree.body:  # module level only: a lazy import inside a function is the seam
        if isinstance(stmt, ast.Import):
            found |= {a.name for a in stmt.names}
        elif isinstance(stmt, ast.ImportFrom) and stmt.module:
            found.add(stmt.module)
    return found


def test_core_modules_import_neither_torch_nor_figures_at_module_level():
    for name in CORE:
        imported = top_level_imports(PACKAGE / name)
        bad = {m for m in imported if m.split(".")[0] in {"torch", "IPython", "ipywidgets"}}
        bad |= {m for m in imported if m.startswith(("somatize.torch", "somatize.figures"))}
        assert not bad, f"{name} imports {sorted(bad)} at module level"


def test_import_somatize_stays_light():
    code = (
        "import sys, somatize; "
        "print(','.join(m for m in ('torch','pandas','IPython','ipywidgets','zmq','anywidget')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
