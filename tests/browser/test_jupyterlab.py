"""The figures in a real JupyterLab: a server on 127.0.0.1, a notebook opened in headless
Chromium, cells run with Shift+Enter, the widgets' DOM checked — the graph's boxes and edges,
a fold that opens on click (and reaches the kernel), heatmap cells that appear while the fit
cell is still running, a table that sorts on a header click."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

CELLS = [
    # 0: a real graph with what its nodes are made of
    """
import torch
from torch import nn
from somatize import Graph, Node
from somatize.torch import architecture

class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)

class Enc(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.blocks = nn.Sequential(Res(8), Res(8), Res(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
    def forward(self, x, ctx=None):
        return self.flat(self.pool(self.blocks(self.act(self.conv(x)))))

class Branch(Node, nn.Module):
    def __init__(self, relu=False):
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Linear(8, 16), *([nn.ReLU()] if relu else []))
    def forward(self, x, ctx=None):
        return self.net(x)

class Join(Node):
    def forward(self, x, ctx):
        return sum(x.values())

g = Graph.somatize(
    Enc().named("enc").on("cpu") >> (Branch(True).named("left") | Branch().named("right"))
    >> Join().named("join")
)
x = torch.randn(4, 3, 8, 8)
fig = g.figure(inside=architecture(g, x))
fig
""",
    # 1: what the browser changed, read back in the kernel
    "print('expanded:', fig.expanded)",
    # 2: the live audit, shown before the fit starts
    """
from somatize.figures import LiveAudit
audit = LiveAudit(title="mlp")
audit
""",
    # 3: a fit: a hand loop of MLP steps that hands loss and health facts to the audit
    """
import time
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(mlp.parameters(), lr=0.05)
xs, ys = torch.randn(256, 16), torch.randint(0, 4, (256,))
for step in range(60):
    loss = nn.functional.cross_entropy(mlp(xs), ys)
    opt.zero_grad(); loss.backward(); opt.step()
    audit({"fact": "loss", "value": loss.item(), "step": step})
    for name in ("0", "2", "4"):
        w = mlp.get_submodule(name).weight
        grad = w.grad.norm().item()
        audit({"fact": "health", "where": f"mlp.{name}", "step": step,
               "numbers": {"grad_norm": grad, "update_ratio": 0.05 * grad / w.norm().item()}})
    time.sleep(0.08)
print("fit done", audit.metrics, len(audit.frame()))
""",
    # 4: candidates compared
    """
import pandas as pd
from somatize.figures import CompareTable
df = pd.DataFrame({"params": [1200, 56000, 8000], "proxy:synflow": [3.0, 9.5, 7.1]},
                  index=pd.Index(["tiny", "wide", "deep"], name="candidate"))
CompareTable(df, measured={"tiny": 0.6, "wide": 0.95, "deep": 0.9})
""",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with temporary config and runtime dirs."""
    work = tmp_path_factory.mktemp("lab")
    config, runtime, root = work / "config", work / "runtime", work / "root"
    for d in (config, runtime, root):
        d.mkdir()
    (config / "labconfig").mkdir()
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.strip()) for c in CELLS]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, root / "figures.ipynb")
    port, token = _free_port(), "somatize-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(runtime)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "jupyter"),
            "lab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(work / "lab.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError((work / "lab.log").read_text()[-3000:]) from None
            time.sleep(0.3)
    yield f"{base}/lab/tree/figures.ipynb?token={token}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _run(page, index):
    """Run one cell; again if the kernel's first connection dropped the request."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    prompt = cell.locator(".jp-InputPrompt")
    for _ in range(4):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            if prompt.inner_text().strip() not in ("[ ]:", ""):
                return cell
            page.wait_for_timeout(100)
    raise AssertionError(f"cell {index} never started running")


def test_figures_live_in_jupyterlab(chromium, lab, artifacts):
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        page.goto(lab)
        page.wait_for_selector(
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
        # the graph: boxes, edges, a folded block that opens on click
        cell = _run(page, 0)
        cell.locator(".smz-graph svg .smz-node").first.wait_for(timeout=60_000)
        assert cell.locator(".smz-node").count() == 4
        assert cell.locator(".smz-edge").count() >= 4 + 8
        assert cell.locator(".smz-kind-conv").count() == 2
        cell.locator(".smz-foldable").click()
        page.wait_for_function(
            "() => document.querySelectorAll('.smz-kind-conv').length === 4", timeout=15_000
        )
        page.wait_for_timeout(300)
        cell.screenshot(path=str(artifacts / "lab-graph.png"))
        out = _run(page, 1)
        out.locator(".jp-OutputArea-output").wait_for(timeout=30_000)
        assert "expanded: ['enc:blocks.0']" in out.locator(".jp-OutputArea-output").inner_text()

        # the audit: cells appear while the fit cell is still running
        audit = _run(page, 2)
        audit.locator(".smz-audit").wait_for(timeout=30_000)
        fit = _run(page, 3)
        page.wait_for_function(
            "() => document.querySelectorAll('.smz-audit .smz-cell').length >= 3",
            timeout=30_000,
        )
        running = fit.locator(".jp-InputPrompt").inner_text()
        early = audit.locator(".smz-cell").count()
        assert "[*]" in running, running  # the fit cell has not finished
        assert early < 3 * 60
        audit.screenshot(path=str(artifacts / "lab-audit-running.png"))
        done = fit.locator(".jp-OutputArea-output:has-text('fit done')")
        done.wait_for(timeout=60_000)
        # read right after the fit: everything is there, whatever was sent
        assert "['grad_norm', 'update_ratio'] 180" in done.inner_text()
        page.wait_for_function(
            "() => document.querySelectorAll('.smz-audit .smz-cell').length === 180",
            timeout=10_000,
        )
        assert audit.locator(".smz-loss").count() == 1
        audit.screenshot(path=str(artifacts / "lab-audit.png"))

        # the table sorts on a header click
        table = _run(page, 4)
        table.locator(".smz-table tbody tr").first.wait_for(timeout=30_000)
        rows = lambda: table.locator("tbody tr").evaluate_all(  # noqa: E731
            "rs => rs.map(r => r.dataset.row)"
        )
        assert rows() == ["wide", "deep", "tiny"]
        table.locator("thead th[data-col='params']").click()
        table.locator("thead th[data-col='params']").click()
        assert rows() == ["tiny", "deep", "wide"]
        table.screenshot(path=str(artifacts / "lab-table.png"))
    finally:
        page.screenshot(path=str(artifacts / "lab-page.png"), full_page=True)
        context.close()
