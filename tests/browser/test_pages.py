"""Pages made without JupyterLab, opened from a file:// URL with the network cut off: a
notebook run by `notebooks/execute.py`, or by `jupyter nbconvert --execute` (which keeps the
widgets' state, so that nbconvert writes each widget's view, drawn by a manager from the
network), and converted by nbconvert shows every figure's static face; the page `make demo`
writes shows the three figures alive."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]

SOURCE = [
    """
import torch
from torch import nn
from somatize import Graph, Node
from somatize.figures import CompareTable, LiveAudit
from somatize.torch import architecture

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU()
    def forward(self, x):
        return self.act(self.lin(x))

class Deep(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.blocks = nn.Sequential(Block(), Block(), Block())
    def forward(self, x, ctx):
        return self.blocks(x)

torch.manual_seed(0)
g = Graph.somatize(Deep())
g.figure(inside=architecture(g, torch.randn(4, 8)))
""",
    'audit = LiveAudit(title="by hand")\naudit',
    """
for step in range(30):
    audit({"fact": "loss", "value": 1 / (step + 1), "step": step})
    audit({"fact": "health", "node": "deep", "step": step, "update_ratio": 1e-3, "grad_norm": 0.1})
""",
    """
import pandas as pd
CompareTable(pd.DataFrame({"params": [10, 20, 30], "proxy:zen": [1.0, 3.0, 2.0]}, index=["a", "b", "c"]),
             measured={"a": 0.1, "b": 0.3, "c": 0.2})
""",
]


def _offline(page):
    asked = []

    def cut_off(route):
        asked.append(route.request.url)
        route.abort()

    page.route("http*://**/*", cut_off)
    return asked


def _nbconvert(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", *args],
        check=True, capture_output=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize("run_by", ["execute.py", "nbconvert --execute"])
def test_a_converted_notebook_shows_every_face_offline(tmp_path, page, artifacts, run_by):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in SOURCE])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "figures.ipynb"
    nbformat.write(nb, path)
    if run_by == "execute.py":
        spec = importlib.util.spec_from_file_location("execute", ROOT / "notebooks" / "execute.py")
        execute = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(execute)
        execute.execute(path)  # the way committed outputs are made: no widget state
    else:
        _nbconvert("--to", "notebook", "--execute", "--inplace", str(path))
    saved = nbformat.read(path, 4)
    assert ("widgets" in saved.metadata) == (run_by != "execute.py")
    _nbconvert("--to", "html", str(path))
    asked = _offline(page)
    page.goto((tmp_path / "figures.html").as_uri())
    faces = page.locator(".smz-face > img")
    faces.nth(1).wait_for(timeout=20_000)
    page.wait_for_function("() => [...document.querySelectorAll('.smz-face > img')].every(i => i.naturalWidth > 100)")
    assert faces.count() == 2 and "30 steps" in faces.nth(1).get_attribute("alt")
    assert all(faces.nth(k).is_visible() for k in range(2))
    assert page.locator(".smz-table-face tbody tr").count() == 3
    assert page.locator(".smz-table-face").is_visible()
    shot = "nbconvert.png" if run_by == "execute.py" else "nbconvert-widget-state.png"
    page.screenshot(path=str(artifacts / shot), full_page=True)
    # where a live view is drawn (as html-manager would, online), its face gives way to it
    live = page.evaluate("""() => {
        const key = document.querySelector(".smz-face[data-smz-for]").dataset.smzFor;
        const view = document.createElement("div");
        view.className = `smz-live-${key}`;
        document.body.append(view);
        return key;
    }""")
    assert page.locator(f".smz-face[data-smz-for='{live}']").is_hidden()
    assert page.locator(".smz-face").evaluate_all("fs => fs.filter(f => f.offsetParent).length") == 2
    # what nbconvert's page asks the network for (MathJax, require.js, the widget manager); no figure
    nbconvert_asks = ("https://cdnjs.cloudflare.com/ajax/libs/", "https://unpkg.com/@jupyter-widgets/")
    assert asked and all(url.startswith(nbconvert_asks) for url in asked), asked


def test_the_demo_page_shows_the_three_figures_alive_offline(tmp_path, page, artifacts):
    from somatize import demo

    drawn = demo.figures()
    demo.write_page(drawn, tmp_path / "demo.html")
    asked = _offline(page)
    page.goto((tmp_path / "demo.html").as_uri())
    page.wait_for_selector("body[data-rendered='yes']", timeout=20_000)
    assert page.locator(".smz-graph .smz-layer").count() >= 8  # a graph with insides
    page.wait_for_function("() => Number(document.querySelector('.smz-audit').dataset.coloured) > 20")
    assert page.locator(".smz-loss").count() == 1
    assert page.locator(".smz-table tbody tr").count() == 4
    page.select_option(".smz-metric", "grad_norm")
    assert page.evaluate("document.querySelector('.smz-audit').dataset.metric") == "grad_norm"
    page.locator(".smz-table thead th[data-col='params']").click()
    rows = page.locator(".smz-table tbody tr").evaluate_all("rs => rs.map(r => r.dataset.row)")
    assert rows == ["hidden 64", "hidden 16", "hidden 4", "hidden 2"]
    page.screenshot(path=str(artifacts / "demo.png"), full_page=True)
    assert asked == [] and page.errors == []
