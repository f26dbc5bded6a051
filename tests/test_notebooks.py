"""The notebooks as committed: with their outputs, without widget state, on data that ships
with a package, and written down in the guides. (nbval runs them: `make test-notebooks`.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TOUR = [
    "01_tour",
    "02_training",
    "03_split_learning",
    "04_federated",
    "05_health",
    "06_choosing_an_architecture",
    "07_your_own_model",
    "08_four_ways",
]


def _build():
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tour_is_there_and_every_notebook_has_its_number():
    stems = [p.stem for p in NOTEBOOKS]
    assert stems[: len(TOUR)] == TOUR
    assert [s[:3] for s in stems] == [f"{k:02d}_" for k in range(1, len(stems) + 1)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_outputs_and_without_widget_state(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert "widgets" not in nb["metadata"], f"{path.name}: strip it (python notebooks/execute.py)"
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, path.name
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: run top to bottom, once"
    assert sum(bool(c["outputs"]) for c in code) >= len(code) // 2
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert errors == []
    assert path.stat().st_size < 200_000


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_nothing_is_downloaded(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for word in ("http://", "https://", "urlopen", "download=True", "fetch_openml"):
        assert word not in source, f"{path.name} reaches the network ({word})"


def test_the_guides_say_what_the_notebooks_do():
    stale = _build().guides(check=True)
    assert stale == [], "run: python docs/build.py"


def test_a_guide_holds_the_code_and_its_outputs_and_no_nbval_markers():
    build = _build()
    text = build.guide(ROOT / "notebooks" / "03_split_learning.ipynb")
    assert "Worker.spawn" in text and "NBVAL" not in text
    assert "step for step the same losses as in one process: True" in text


def test_a_figure_run_by_nbconvert_has_its_picture_in_the_html(tmp_path):
    """`jupyter nbconvert --execute` keeps the widgets' state, so its HTML has each widget's
    view (a widget manager from the network draws it); the face, an output of its own, is
    there too. (tests/browser/test_pages.py opens such a page offline.)"""
    import nbformat

    source = 'from somatize.figures import LiveAudit\nLiveAudit(title="by nbconvert")'
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "figure.ipynb"
    nbformat.write(nb, path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for how in (["--to", "notebook", "--execute", "--inplace"], ["--to", "html"]):
        done = subprocess.run(
            [sys.executable, "-m", "jupyter", "nbconvert", *how, str(path)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    page = (tmp_path / "figure.html").read_text(encoding="utf-8")
    assert "application/vnd.jupyter.widget-state+json" in page  # the widget's view is there
    assert page.count('<img alt="by nbconvert: ') == 1  # and its picture
