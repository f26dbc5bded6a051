"""Candidates compared before anyone trains them: a DataFrame first, a sortable widget second.

df = compare({"wide": g1, "deep": g2}, x, target=y, objective=loss)
CompareTable(df, measured={"wide": 0.91, "deep": 0.87})
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from somatize.figures._page import STATIC, jsonable, page
from somatize.graph import as_graph

__all__ = ["CompareTable", "compare"]

PROBE = "probe:"
PROXY = "proxy:"


def _parameter_count(graph: Any) -> int:
    try:
        from somatize.torch import parameters
    except ImportError:
        parameters = None
    if parameters is not None:
        return sum(p.numel() for p in parameters(graph))
    seen, total = set(), 0
    for node in graph.nodes():
        impl = graph.implementation(node)
        for p in getattr(impl, "parameters", lambda: [])():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _optional(module: str, name: str) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _probe_summary(numbers: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """The median over places of every metric a probe gave."""
    by_metric: dict[str, list[float]] = {}
    for values in numbers.values():
        for metric, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v):
                by_metric.setdefault(metric, []).append(float(v))
    return {f"{PROBE}{m}": statistics.median(vs) for m, vs in sorted(by_metric.items())}


def compare(
    candidates: Mapping[str, Any],
    example: Any,
    *,
    target: Any = None,
    objective: Any = None,
    measured: Mapping[str, float] | None = None,
) -> Any:
    """Probe summaries and proxies of several candidate graphs, side by side, before training.

    A pandas DataFrame with a row per candidate (in the order given) and columns: `params`
    (parameter count), `probe:<metric>` (the median over places of what
    `somatize.torch.probe` measured at initialisation), `proxy:<name>` (every score
    `somatize.torch.proxies` could take with what it was given; higher is better), and
    `measured` when given (`{candidate: number}`, e.g. accuracy after training). Refused:
    no candidates, a measured value for a candidate that is not there."""
    import pandas as pd

    if not candidates:
        raise ValueError("compare() needs at least one candidate: {name: Graph}")
    if measured is not None:
        unknown = [k for k in measured if k not in candidates]
        if unknown:
            raise ValueError(
                f"measured= names {', '.join(map(repr, unknown))}, not among the candidates "
                f"({', '.join(map(repr, candidates))})"
            )
    probe = _optional("somatize.torch", "probe")
    proxies = _optional("somatize.torch", "proxies")
    rows = {}
    for name, graph in candidates.items():
        graph = as_graph(graph)  # a bare module is a graph of one node
        row: dict[str, Any] = {"params": _parameter_count(graph)}
        if probe is not None:
            row.update(_probe_summary(probe(graph, example)))
        if proxies is not None:
            scores = proxies(graph, example, target=target, objective=objective)
            row.update({f"{PROXY}{k}": float(v) for k, v in scores.items()})
        if measured is not None:
            value = measured.get(name)
            row["measured"] = float(value) if value is not None else math.nan
        rows[str(name)] = row
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = "candidate"
    return df


def _correlations(df: Any, measured: str) -> dict[str, float | None]:
    import pandas as pd

    out: dict[str, float | None] = {}
    for column in df.columns:
        if column == measured:
            continue
        pair = df[[column, measured]].apply(pd.to_numeric, errors="coerce").dropna()
        if len(pair) < 3 or pair[column].nunique() < 2 or pair[measured].nunique() < 2:
            out[column] = None
            continue
        rho = pair[column].rank().corr(pair[measured].rank())
        out[column] = float(rho) if math.isfinite(rho) else None
    return out


def _direction(column: str, measured: str) -> bool | None:
    """Higher is better for proxies and the measured column; the rest are not ranked."""
    if column == measured or column.startswith(PROXY):
        return True
    return None


class CompareTable(anywidget.AnyWidget):
    """A comparison table as a widget: a row per candidate, sorted by a click on a column's
    header (again to reverse), proxy and measured cells coloured by their rank in their column
    (best green), and, with a measured column, a last row of each column's Spearman rank
    correlation with it. Refused: a measured column the DataFrame does not have."""

    _esm = STATIC / "table.js"
    _css = STATIC / "table.css"

    data = traitlets.Dict().tag(sync=True)
    index_name = traitlets.Unicode("candidate").tag(sync=True)
    higher_better = traitlets.Dict().tag(sync=True)
    measured = traitlets.Unicode("").tag(sync=True)
    correlations = traitlets.Dict().tag(sync=True)
    sort_by = traitlets.Unicode("").tag(sync=True)
    ascending = traitlets.Bool(False).tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)

    def __init__(self, df: Any, *, measured: Any = None, higher_better: Any = None) -> None:
        import pandas as pd

        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"CompareTable shows a pandas DataFrame, not {type(df).__name__}")
        df = df.copy()
        column = ""
        if isinstance(measured, str):
            if measured not in df.columns:
                raise ValueError(
                    f"measured={measured!r} is not a column of this table "
                    f"({', '.join(map(str, df.columns))})"
                )
            column = measured
        elif measured is not None:
            values = pd.Series(dict(measured), dtype=float)
            unknown = [k for k in values.index if k not in df.index]
            if unknown:
                raise ValueError(
                    f"measured= names {', '.join(map(repr, unknown))}, not rows of this table"
                )
            column = "measured"
            df[column] = values.reindex(df.index)
        elif "measured" in df.columns:
            column = "measured"
        df.columns = [str(c) for c in df.columns]
        directions = {c: _direction(c, column) for c in df.columns}
        directions.update(dict(higher_better or {}))
        super().__init__(
            data={
                "index": [str(i) for i in df.index],
                "columns": list(df.columns),
                "values": jsonable(df.astype(object).where(df.notna(), None).values.tolist()),
            },
            index_name=str(df.index.name or "candidate"),
            higher_better=directions,
            measured=column,
            correlations=_correlations(df, column) if column else {},
            sort_by=column,
            note="" if not column else f"ρ: Spearman rank correlation with {column}",
        )
        self.frame = df

    def save_html(self, path: str | Path) -> Path:
        """Write a standalone HTML page with the table (sortable) in it, drawn offline."""
        path = Path(path)
        state = {
            k: getattr(self, k)
            for k in (
                "data",
                "index_name",
                "higher_better",
                "measured",
                "correlations",
                "sort_by",
                "ascending",
                "note",
            )
        }
        path.write_text(page("table", state, title="comparison"), encoding="utf-8")
        return path
