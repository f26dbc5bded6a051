"""The seam between the core and torch: the core and `somatize.remote` ask `somatize._hooks`,
which `somatize.torch` fills on import, and import nothing of `somatize.torch` themselves."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from somatize import _hooks

PACKAGE = Path(__file__).resolve().parent.parent / "somatize"
CORE = [
    "node.py",
    "graph.py",
    "run.py",
    "caching.py",
    "_keys.py",
    "store.py",
    "codecs.py",
    "record.py",
]


def imported(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "somatize":
                found |= {f"somatize.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize(
    "path",
    [PACKAGE / name for name in CORE] + sorted((PACKAGE / "remote").glob("*.py")),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_core_and_remote_import_nothing_of_somatize_torch_not_even_lazily(path):
    bad = sorted(
        m for m in imported(path) if m == "somatize.torch" or m.startswith("somatize.torch.")
    )
    assert bad == [], f"{path.relative_to(PACKAGE)} imports {bad}: ask through somatize._hooks"


def test_register_refuses_an_unknown_question_and_replaces_nothing():
    before = _hooks.move
    with pytest.raises(ValueError, match="'nope'.*known"):
        _hooks.register(move=lambda value, device: None, nope=lambda: None)
    assert _hooks.move is before


def test_a_graph_of_plain_nodes_runs_without_torch_and_importing_torch_fills_the_hooks():
    code = """
import sys
from somatize import Graph, Node, _hooks

class Add(Node):
    def forward(self, input, ctx):
        return input + 1

assert Graph.somatize(Add() >> Add()).forward(1) == 3
assert "torch" not in sys.modules and "somatize.torch" not in sys.modules
assert _hooks.trainable(object()) is False and _hooks.move(3, "cpu") == 3
import torch
from torch import nn

_hooks.ready()
assert "somatize.torch" in sys.modules
assert _hooks.trainable(nn.Linear(2, 2)) is True
assert _hooks.move(torch.ones(1), "meta").device.type == "meta"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
