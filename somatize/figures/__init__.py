"""Figures: the graph drawn with what each node is made of, a run's health filling in while it
trains, and candidates compared before anyone trains them. Each is an anywidget whose picture
is made here in Python; the same picture is its static face and what `save_svg` writes.
"""

from __future__ import annotations

from somatize.figures.audit import LiveAudit
from somatize.figures.graph import GraphFigure, graph_figure
from somatize.figures.table import CompareTable, compare

__all__ = ["CompareTable", "GraphFigure", "LiveAudit", "compare", "graph_figure"]
