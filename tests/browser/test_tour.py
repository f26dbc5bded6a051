"""The tour's page (`python -m somatize.tour`, what `make demo` writes): a notebook run headless
and written as one HTML file whose widgets draw from a file:// URL with the network cut off."""

from __future__ import annotations

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from somatize import tour

SOURCE = """
import torch
from torch import nn
from somatize import Graph, Node
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


class Head(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.lin = nn.Linear(8, 2)

    def forward(self, x, ctx):
        return self.lin(x)


torch.manual_seed(0)
g = Graph.somatize(Deep() >> Head())
g.figure(inside=architecture(g, torch.randn(4, 8), depth=2))
"""


def _drawn(page, n):
    page.wait_for_function(
        f"() => Number(document.querySelector('.smz-graph')?.dataset.drawn) >= {n}"
    )


def test_the_page_draws_its_widgets_offline_and_they_respond(tmp_path, page, artifacts):
    nb = new_notebook(cells=[new_code_cell(SOURCE), new_code_cell("print(len(g))")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    path = tmp_path / "small.ipynb"
    nbformat.write(nb, path)
    html = tmp_path / "small.html"
    html.write_text(tour.page(tour.run(path)), encoding="utf-8")
    text = html.read_text(encoding="utf-8")
    assert "<script src=" not in text  # no require.js, no widget manager, no MathJax to fetch

    asked = []

    def cut_off(route):
        asked.append(route.request.url)
        route.abort()

    page.route("http*://**/*", cut_off)
    page.goto(html.as_uri())
    page.wait_for_selector("body[data-widgets='done']", timeout=20_000)
    assert page.locator(".smz-tour-widget[data-rendered='true']").count() == 1
    _drawn(page, 1)
    assert page.locator(".smz-node").count() == 2
    folded = page.locator(".smz-foldable")
    assert "×3" in folded.first.text_content()
    before = page.locator(".smz-edge").count()
    page.screenshot(path=str(artifacts / "tour-folded.png"), full_page=True)

    folded.first.click()  # the widget's own code, answering in a page with no kernel
    _drawn(page, 2)
    assert page.locator(".smz-edge").count() > before
    page.screenshot(path=str(artifacts / "tour-unfolded.png"), full_page=True)
    assert "2" in page.locator(".jp-OutputArea-output pre").last.text_content()
    assert asked == [] and page.errors == []
