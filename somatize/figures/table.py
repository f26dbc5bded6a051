"""Candidates compared before anyone trains them: a DataFrame first, a table widget second.

df = compare({"wide": g1, "deep": g2}, x, target=y, objective=loss)
CompareTable(df, measured={"wide": 0.91, "deep": 0.87})
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping
from typing import Any

import anywidget
import traitlets

from somatize.figures._page import STATIC, Face, jsonable
from somatize.figures._svg import finite, number, svg_open, text_width
from somatize.figures._table_face import NAMES, WIDEST, html
from somatize.graph import as_graph
from somatize.health import METRICS, Verdicts, verdict
from somatize.run import note, warn

__all__ = ["CompareTable", "compare"]

# a column's prefix: what the probe measured, a proxy's score
PROBE = "probe:"
PROXY = "proxy:"
FLAGS = f"{PROBE}flags"
# what each proxy says, in one sentence, for its column's tooltip
PROXIES = {
    "synflow": "Synaptic flow: how much signal can flow through the weights' magnitudes at all "
    "(log; Tanaka et al. 2020).",
    "zen": "Zen score: how strongly the output responds to a small change of the input, "
    "normalised by the batch norms (Lin et al. 2021).",
    "naswot": "How differently the ReLUs fire for different inputs (log-determinant of their "
    "codes' kernel; Mellor et al. 2021).",
    "jacob_cov": "How independent the input gradients of different samples are (Mellor et al. "
    "2020).",
    "snip": "How much the loss depends on the weights as they are (Σ|θ·∂L/∂θ|, log; Lee et al. "
    "2019).",
    "grasp": "How much pruning would hurt the gradient flow (−θ·H·∂L/∂θ; Wang et al. 2020).",
    "grad_norm": "The size of the loss's gradient over every weight (log).",
    "fisher": "How much the loss depends on each layer's outputs (Fisher information, log; "
    "Theis et al. 2018).",
}


def _named(candidates: Any) -> dict[str, Any]:
    """Candidates as {name: graph}: a mapping as it is, a list or tuple named after what
    each is (a module's class, a graph's nodes), a repeated name numbered."""
    if isinstance(candidates, Mapping):
        return {str(k): v for k, v in candidates.items()}
    if not isinstance(candidates, (list, tuple)):
        raise TypeError(
            f"compare() takes the candidates as {{name: graph}} or a list of graphs, not "
            f"{type(candidates).__name__}"
        )
    out: dict[str, Any] = {}
    for graph in candidates:
        nodes = getattr(graph, "nodes", None)
        if callable(nodes) and hasattr(graph, "implementation"):
            ids = list(nodes())
            if len(ids) > 4:
                ids = [ids[0], "…", f"{ids[-1]} ({len(ids)})"]
            name = " → ".join(ids)
        else:
            name = type(graph).__name__
        base, k = name, 2
        while name in out:
            name, k = f"{base} ({k})", k + 1
        out[name] = graph
    return out


def _probe_summary(facts: list[dict]) -> dict[str, Any]:
    """The median over places of every metric a probe gave, and the flags the health
    verdict raises at any place (as `FLAG@where` text), read from the probe's health facts,
    where a block answered with its last box's numbers says it repeats that box instead."""
    seen = Verdicts(last=None).feed(facts)
    by_metric: dict[str, list[float]] = {}
    for values in seen.numbers().values():
        for metric, v in values.items():
            if finite(v):
                by_metric.setdefault(metric, []).append(float(v))
    medians = {f"{PROBE}{m}": statistics.median(vs) for m, vs in sorted(by_metric.items())}
    flags = [f"{f}@{where}" for where, found in seen.flags().items() for f in found]
    return {**medians, FLAGS: ", ".join(flags)}


def compare(
    candidates: Any,
    example: Any,
    *,
    target: Any = None,
    objective: Any = None,
    measured: Mapping[str, float] | None = None,
) -> Any:
    """Probe summaries and proxies of several candidate graphs, side by side, before training.

    `candidates` is `{name: graph}` or a list of graphs (or bare modules), named then after
    their nodes or their class. A pandas DataFrame with a row per candidate, in the order
    given, and columns: `params` (parameter count), `proxy:<name>` (every score
    `somatize.torch.proxies` could take with what it was given; higher is better),
    `probe:<metric>` (the median over places of what `somatize.torch.probe` measured at
    initialisation), `probe:flags` (what `somatize.health.verdict` says of any place), and
    `measured` when given (`{candidate: number}`, e.g. accuracy after training). A proxy
    left out of a candidate is NaN in its row, warned with the candidate's name, and why is
    in `df.attrs["left_out"]` (`{candidate: {column: why}}`, which `CompareTable` shows).
    Refused: no candidates, a measured value for a candidate that is not there."""
    import pandas as pd

    from somatize.torch import EVERY, ProxyLeftOut, parameters, probe, proxies

    named = _named(candidates)
    if not named:
        raise ValueError("compare() needs at least one candidate: {name: graph} or [graph, ...]")
    if measured is not None:
        measured = _measured(list(named), measured)
    rows: dict[str, dict[str, Any]] = {}
    left_out: dict[str, dict[str, str]] = {}
    for name, graph in named.items():
        graph = as_graph(graph)  # a bare module is a graph of one node
        try:  # the proxies first: they refuse a candidate that cannot be looked at, clearly
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                scores = proxies(graph, example, target=target, objective=objective)
                facts: list[dict] = []
                probe(graph, example, watching=facts.append)
                looked = _probe_summary(facts)
        except ValueError as error:
            raise ValueError(f"candidate {name!r}: {error}") from None
        except Exception as error:  # a candidate that does not run: which one, as a note
            note(error, f"candidate {name!r}")
            raise
        for w in said:  # what was left out of which candidate, and why
            out = w.message
            if isinstance(out, ProxyLeftOut):
                warn(ProxyLeftOut(out.proxy, out.why, candidate=name))
                left_out.setdefault(name, {})[f"{PROXY}{out.proxy}"] = out.why
            else:
                warn(f"candidate {name!r}: {out}", w.category)
        proxied = {f"{PROXY}{k}": float(v) for k, v in scores.items()}
        rows[name] = {"params": sum(p.numel() for p in parameters(graph)), **proxied, **looked}
    df = pd.DataFrame.from_dict(rows, orient="index")
    if measured is not None:
        df["measured"] = measured
    # the same columns in the same order whichever candidate a proxy was left out of
    first = ["params", "measured", *(f"{PROXY}{p}" for p in EVERY)]
    probed = sorted(c for c in df.columns if c.startswith(PROBE) and c != FLAGS)
    df = df[[c for c in first if c in df.columns] + probed + [FLAGS]]
    df.index.name = "candidate"
    df.attrs["left_out"] = left_out
    return df


def _measured(names: list[Any], measured: Any) -> Any:
    """`measured` ({candidate: number}) as a float Series over `names`, NaN where not given;
    refused for a name not among them."""
    import pandas as pd

    values = pd.Series(dict(measured), dtype=float)
    unknown = [k for k in values.index if k not in names]
    if unknown:
        raise ValueError(
            f"measured= names {', '.join(map(repr, unknown))}, not among the candidates "
            f"({', '.join(map(repr, names))})"
        )
    return values.reindex(names)


def _correlations(df: Any, measured: str) -> dict[str, float | None]:
    """Each numeric column's Spearman rank correlation with `measured` over the rows that
    have both (an infinity ranks); None under 3 such rows or where either is constant."""
    out: dict[str, float | None] = {}
    for column in df.columns.drop(measured):
        pair = df[[column, measured]].dropna()
        # a constant column has no correlation: not asked of pandas (older numpy warns on it)
        varies = len(pair) >= 3 and (pair.nunique() > 1).all()
        rho = pair[column].rank().corr(pair[measured].rank()) if varies else math.nan
        out[column] = float(rho) if math.isfinite(rho) else None
    return out


def _group(column: str, measured: str) -> str:
    if column == measured:
        return "measured"
    if column == "params":
        return "size"
    return next((g for g in ("proxy", "probe") if column.startswith(f"{g}:")), "other")


_ORDER = ("measured", "size", "proxy", "probe", "other")


class CompareTable(Face, anywidget.AnyWidget):
    """A comparison table as a widget: a row per candidate, its name kept in view when the
    table scrolls, `measured` next to it, then the size, the proxy scores and the probe's
    numbers, grouped; columns past 1400 px (the probe's first) behind a toggle. A click on a
    header sorts (again to reverse). Proxy and measured cells are coloured by their rank in
    their column (best green); a probe value the health verdict flags is tinted red; with a
    measured column, a last row holds each column's Spearman rank correlation with it, and a
    scatter plots any score (chosen from a menu) against it. Every number is written one way;
    every column is explained in its header's tooltip and under the table, and why a proxy
    was left out of a candidate (`df.attrs["left_out"]`, as `compare` gives it) in its empty
    cell's tooltip and in a note under the table. Refused: a measured column the DataFrame
    does not have, measured values for rows it does not have."""

    _bundle = "table"
    _esm = STATIC / "table.js"
    _css = STATIC / "table.css"
    _saved = ("table", "sort_by", "ascending", "shown", "scatter", "drawing")

    table = traitlets.Dict().tag(sync=True)
    sort_by = traitlets.Unicode("").tag(sync=True)
    ascending = traitlets.Bool(False).tag(sync=True)
    shown = traitlets.List(traitlets.Unicode()).tag(sync=True)
    scatter = traitlets.Unicode("").tag(sync=True)
    drawing = traitlets.Unicode("").tag(sync=True)

    def __init__(self, df: Any, *, measured: Any = None) -> None:
        import pandas as pd

        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"CompareTable shows a pandas DataFrame, not {type(df).__name__}")
        df = df.copy()
        df.columns = [str(c) for c in df.columns]
        if measured is not None and not isinstance(measured, str):
            df["measured"] = _measured(list(df.index), measured)
        column = measured if isinstance(measured, str) else "measured"
        if measured is None and column not in df.columns:
            column = ""
        elif column not in df.columns:
            raise ValueError(
                f"measured={column!r} is not a column of this table "
                f"({', '.join(map(str, df.columns))})"
            )
        groups = {c: _group(c, column) for c in df.columns}
        df = df[sorted(df.columns, key=lambda c: _ORDER.index(groups[c]))]  # stable: in order
        correlations = _correlations(df.select_dtypes("number"), column) if column else {}
        scored = [c for c in df.columns if groups[c] == "proxy" and correlations.get(c) is not None]
        best = max(scored, key=lambda c: abs(correlations[c]), default="")
        table = {
            "index": [str(i) for i in df.index],
            "index_name": str(df.index.name or "candidate"),
            "columns": list(df.columns),
            "values": jsonable(df.astype(object).where(df.notna(), None).values.tolist()),
            "groups": groups,
            "measured": column,
            "correlations": correlations,
            "explain": _explain(df.columns, column),
            "flagged": _flagged(df),
            "left_out": _left_out(df),
        }
        super().__init__(table=table, sort_by=column, scatter=best)
        self._draw()
        self.observe(lambda _: self._draw(), ["table", "sort_by", "ascending", "shown", "scatter"])

    def _draw(self) -> None:
        view = {k: getattr(self, k) for k in ("sort_by", "ascending", "scatter")}
        self.drawing = html({**self.table, **view, "hidden": self.hidden()})

    def hidden(self) -> list[str]:
        """The columns behind a toggle: past 1400 px, the probe's first (but `probe:flags`
        where any candidate is flagged), then the others past what fits, unless their group
        was opened (`shown`)."""
        t = self.table
        names = min(NAMES, max(text_width(n, 12, True) for n in [*t["index"], "candidate"]))
        widths = {}
        for j, c in enumerate(t["columns"]):
            texts = [row[j] if isinstance(row[j], str) else number(row[j]) for row in t["values"]]
            head = text_width(c.split(":", 1)[-1], 12, True)
            widths[c] = max([head] + [text_width(x, 12) for x in texts]) + 18
        # a group opened by hand is room given: it does not push others behind a toggle;
        # the sorted column's arrow is on one header at a time
        total = names + 18 + text_width(" ▼", 12, True)
        total += sum(w for c, w in widths.items() if t["groups"][c] not in self.shown)
        # what the health verdict says of a candidate is the probe column never tucked away
        j = t["columns"].index(FLAGS) if FLAGS in t["columns"] else -1
        kept = {FLAGS} if j >= 0 and any(row[j] for row in t["values"]) else set()
        out: list[str] = []
        for group in ("probe", "other", "proxy"):
            if total <= WIDEST:
                break
            if group in self.shown:
                continue
            hideable = [c for c in t["columns"] if t["groups"][c] == group and c not in kept]
            for c in reversed(hideable):
                if total <= WIDEST and group != "probe":
                    break
                out.append(c)
                total -= widths[c]
        return [c for c in t["columns"] if c in out]

    def face(self) -> str:
        """The table as HTML (the scatter and the legend included)."""
        return self.drawing

    def plain(self) -> str:
        """One line: how many candidates, and the best by what."""
        t, by = self.table, f", sorted by {self.sort_by}" if self.sort_by else ""
        return f"comparison of {len(t['index'])} candidates on {len(t['columns'])} columns{by}"

    def svg(self) -> str:
        """The table (its scatter and legend too) as SVG: the HTML held in a foreignObject,
        sized for the rows and the legend it has."""
        t = self.table
        rows = len(t["index"]) + (1 if t["measured"] else 0)
        below = max(270 if t["measured"] else 0, 22 + 17 * len(t["explain"]))
        notes = sum(len(said) for said in t["left_out"].values())
        height = 70 + 26 * rows + 30 + 17 * notes + below
        return (
            f'{svg_open(WIDEST, height)}<foreignObject width="{WIDEST:.0f}" height="{height}">'
            f'<div xmlns="http://www.w3.org/1999/xhtml">{self.drawing}</div></foreignObject></svg>'
        )


def _explain(columns: Any, measured: str) -> dict[str, str]:
    out = {}
    for c in columns:
        if c == measured:
            out[c] = "What was measured after training (accuracy, say): the yardstick for the rest."
        elif c == "params":
            out[c] = "How many parameters the candidate trains."
        elif c == FLAGS:
            out[c] = "What somatize.health.verdict says of the probe at any place (FLAG@where)."
        elif c.startswith(PROXY):
            out[c] = PROXIES.get(c[len(PROXY) :], "A zero-cost proxy score; higher is better.")
        elif c.startswith(PROBE):
            name = c[len(PROBE) :]
            out[c] = "Median over places at initialisation: " + METRICS.get(name, name)
    return out


def _flagged(df: Any) -> dict[str, list[str]]:
    """Probe cells whose value the health verdict flags, as {"row|column": flags}."""
    said = {
        f"{row}|{c}": [str(f) for f in verdict({c[len(PROBE) :]: float(v)})]
        for c in df.columns
        if c.startswith(PROBE) and c != FLAGS
        for row, v in df[c].items()
        if finite(v)
    }
    return {cell: flags for cell, flags in said.items() if flags}


def _left_out(df: Any) -> dict[str, dict[str, str]]:
    """Why a column was left out of a row (as compare() puts it in `df.attrs`; a column left
    out of every row is not in the table, and said too), for the rows the table has."""
    said = dict(df.attrs.get("left_out") or {})
    return {
        str(row): {str(c): str(why) for c, why in dict(said[row]).items()}
        for row in df.index
        if said.get(row)
    }
