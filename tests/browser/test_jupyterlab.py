"""The figures in a real JupyterLab: a server on 127.0.0.1, notebooks opened in headless
Chromium. Live: cells run with Shift+Enter, the graph's fold reaches the kernel and comes back
redrawn, the audit fills while the fit cell is still running and a metric chosen meanwhile
is drawn at once, the table sorts. The static face beside each live view is hidden. Saved: a
notebook run and saved, reopened in a JupyterLab that has no kernel to give it, shows every
figure's static face."""

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

ROOT = Path(__file__).resolve().parents[2]

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
        self.blocks = nn.Sequential(Res(8), Res(8), Res(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
    def forward(self, x, ctx=None):
        return self.flat(self.pool(self.blocks(self.conv(x))))

class Branch(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    def forward(self, x, ctx=None):
        return self.net(x)

class Join(Node):
    def forward(self, x, ctx):
        return sum(x.values())

g = Graph.somatize(Enc().named("enc") >> (Branch().named("left") | Branch().named("right")) >> Join().named("join"))
fig = g.figure(inside=architecture(g, torch.randn(4, 3, 8, 8)))
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
    # 3: a fit by hand, slow enough to look at while it runs
    """
import time
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(mlp.parameters(), lr=0.05)
xs, ys = torch.randn(256, 16), torch.randint(0, 4, (256,))
for step in range(80):
    loss = nn.functional.cross_entropy(mlp(xs), ys)
    opt.zero_grad(); loss.backward(); opt.step()
    audit({"fact": "loss", "value": loss.item(), "step": step})
    for name in ("0", "2", "4"):
        w = mlp.get_submodule(name).weight
        audit({"fact": "health", "node": "mlp", "inside": name, "step": step,
               "grad_norm": w.grad.norm().item(), "update_ratio": 0.05 * w.grad.norm().item() / w.norm().item()})
    time.sleep(0.08)
print("fit done", audit.metrics, len(audit.frame()))
""",
    # 4: the same audit shown again, after the fit: a page opened late gets everything
    "audit",
    # 5: candidates compared
    """
import pandas as pd
from somatize.figures import CompareTable
df = pd.DataFrame({"params": [1200, 56000, 8000], "proxy:synflow": [3.0, 9.5, 7.1], "proxy:zen": [1.0, 2.0, 0.5]},
                  index=pd.Index(["tiny", "wide", "deep"], name="candidate"))
CompareTable(df, measured={"tiny": 0.6, "wide": 0.95, "deep": 0.9})
""",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(cells: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.strip()) for c in cells]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return nb


def _serve(work: Path, *extra: str):
    """A JupyterLab server on 127.0.0.1 over `work/root`, with its own config and runtime."""
    config, runtime, root = work / "config", work / "runtime", work / "root"
    for d in (config, runtime, root):
        d.mkdir(exist_ok=True)
    (config / "labconfig").mkdir(exist_ok=True)
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    port, token = _free_port(), "somatize-test"
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "PYTHONPATH": str(ROOT),
    }
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
            *extra,
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
            return proc, base, token, root
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError((work / "lab.log").read_text()[-3000:]) from None
            time.sleep(0.3)


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab with a kernel, and a notebook of the figures' cells in it."""
    proc, base, token, root = _serve(tmp_path_factory.mktemp("lab"))
    nbformat.write(_notebook(CELLS), root / "figures.ipynb")
    yield f"{base}/lab/tree/figures.ipynb?token={token}"
    _stop(proc)


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
        # the graph: the kernel's drawing; a fold clicked goes to the kernel and comes back drawn
        cell = _run(page, 0)
        cell.locator(".smz-graph svg .smz-node").first.wait_for(timeout=60_000)
        assert (
            cell.locator(".smz-node").count() == 4 and cell.locator(".smz-kind-conv").count() == 2
        )
        # its static face, an output of its own for a saved notebook, gives way to the live view
        assert cell.locator(".smz-face").count() == 1 and cell.locator(".smz-face").is_hidden()
        assert cell.locator(".jp-OutputArea-child").nth(1).is_hidden()
        cell.locator(".smz-foldable").click()
        page.wait_for_function(
            "() => document.querySelectorAll('.smz-graph .smz-kind-conv').length === 4",
            timeout=20_000,
        )
        cell.screenshot(path=str(artifacts / "lab-graph.png"))
        out = _run(page, 1)
        out.locator(".jp-OutputArea-output").wait_for(timeout=30_000)
        assert "expanded: ['enc:blocks.0']" in out.locator(".jp-OutputArea-output").inner_text()

        # the audit: it fills while the fit cell runs; a metric chosen meanwhile is drawn at once
        audit = _run(page, 2)
        audit.locator(".smz-audit").wait_for(timeout=30_000)
        fit = _run(page, 3)
        page.wait_for_function(
            "() => Number(document.querySelector('.smz-audit').dataset.cells) >= 6", timeout=30_000
        )
        assert "[*]" in fit.locator(".jp-InputPrompt").inner_text()  # the fit has not finished
        assert (
            page.evaluate("document.querySelector('.smz-audit').dataset.metric") == "update_ratio"
        )
        audit.locator(".smz-metric").select_option("grad_norm")
        assert page.evaluate("document.querySelector('.smz-audit').dataset.metric") == "grad_norm"
        coloured = int(page.evaluate("document.querySelector('.smz-audit').dataset.coloured"))
        assert "[*]" in fit.locator(".jp-InputPrompt").inner_text() and coloured >= 6
        audit.screenshot(path=str(artifacts / "lab-audit-running.png"))
        done = fit.locator(".jp-OutputArea-output:has-text('fit done')")
        done.wait_for(timeout=90_000)
        assert "['grad_norm', 'update_ratio'] 240" in done.inner_text()
        page.wait_for_function(
            "() => document.querySelector('.smz-audit').dataset.cells === '240'", timeout=15_000
        )
        assert page.evaluate("document.querySelector('.smz-audit').dataset.metric") == "grad_norm"
        audit.screenshot(path=str(artifacts / "lab-audit.png"))
        late = _run(page, 4)
        late.locator(".smz-audit").wait_for(timeout=30_000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.smz-audit')].every(a => a.dataset.cells === '240')",
            timeout=15_000,
        )

        # the table sorts on a header click
        table = _run(page, 5)
        table.locator(".smz-table tbody tr").first.wait_for(timeout=30_000)

        def rows() -> list:
            return table.locator(".smz-table tbody tr").evaluate_all(
                "rs => rs.map(r => r.dataset.row)"
            )

        assert rows() == ["wide", "deep", "tiny"]
        assert table.locator(".smz-face").is_hidden()
        assert (
            page.locator(".smz-face").evaluate_all("fs => fs.filter(f => f.offsetParent).length")
            == 0
        )
        table.locator(".smz-table thead th[data-col='params']").click()
        table.locator(".smz-table thead th[data-col='params']").click()
        assert rows() == ["tiny", "deep", "wide"]
        table.screenshot(path=str(artifacts / "lab-table.png"))
    finally:
        page.screenshot(path=str(artifacts / "lab-page.png"), full_page=True)
        context.close()


def test_a_saved_notebook_reopened_with_no_kernel_shows_every_face(
    chromium, tmp_path_factory, artifacts
):
    from nbclient import NotebookClient

    work = tmp_path_factory.mktemp("saved")
    nb = _notebook(
        [
            CELLS[0],
            CELLS[2],
            CELLS[3].replace("range(80)", "range(12)").replace("time.sleep(0.08)", ""),
            CELLS[5],
        ]
    )
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(work)}}
    ).execute()
    nb.metadata.pop("widgets", None)  # as notebooks/execute.py saves them
    proc, base, token, root = _serve(work, "--KernelSpecManager.allowed_kernelspecs=nobody")
    nbformat.write(nb, root / "saved.ipynb")
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        page.goto(f"{base}/lab/tree/saved.ipynb?token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        faces = page.locator(".jp-OutputArea-output .smz-face > img")
        faces.nth(1).wait_for(timeout=30_000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.smz-face > img')].every(i => i.complete && i.naturalWidth > 200)",
            timeout=15_000,
        )
        assert faces.count() == 2  # the graph and the audit, drawn as they were when saved
        assert "12 steps" in faces.nth(1).get_attribute("alt")  # the audit after its fit
        # the table's cell is the last: JupyterLab may render it only once it is scrolled to
        page.evaluate("document.querySelector('.jp-WindowedPanel-outer')?.scrollTo(0, 1e6)")
        rows = page.locator(".jp-OutputArea-output .smz-table-face table tbody tr")
        rows.nth(2).wait_for(state="attached", timeout=30_000)
        assert rows.count() == 3
        assert (
            page.locator(".jp-OutputArea-output:has-text('Error displaying widget')").count() == 0
        )
        page.screenshot(path=str(artifacts / "lab-reopened.png"), full_page=True)
    finally:
        context.close()
        _stop(proc)
