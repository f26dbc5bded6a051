"""Figures: the graph drawn with what each node is made of, a run's health filling in while it
trains, and candidates compared before anyone trains them.

Each is an anywidget: the picture is made here in Python (SVG, or HTML holding SVG), the
browser half (an ES module bundled in `static/`) shows it live in JupyterLab, Notebook 7,
VS Code and Colab, and the same picture is the figure's static face in a saved notebook,
after nbconvert, on GitHub, and in `save_svg` / `save_html`.
"""

from __future__ import annotations

from somatize.figures.audit import LiveAudit
from somatize.figures.graph import GraphFigure, graph_figure
from somatize.figures.table import CompareTable, compare

__all__ = ["CompareTable", "GraphFigure", "LiveAudit", "compare", "graph_figure"]
