"""The graph figure and the comparison table through their public API: what they hold, what
they refuse, what they draw (the SVG / HTML that is both the live view and the static face).

The live audit is tested in test_live_audit.py, the browser halves in a real Chromium under
tests/browser/."""

from __future__ import annotations

import base64
import itertools
import math
import re
import warnings
import xml.etree.ElementTree as ET

import figure_data as fd
import pandas as pd
import pytest
import torch
from torch import nn

from somatize import Graph, Node
from somatize.figures import CompareTable, GraphFigure, LiveAudit, compare, graph_figure
from somatize.torch import ProxyLeftOut

SVG = "{http://www.w3.org/2000/svg}"


class Lin(Node, nn.Module):
    """A linear layer as a node."""

    def __init__(self, i: int = 4, o: int = 4) -> None:
        nn.Module.__init__(self)
        self.fc = nn.Linear(i, o)

    def forward(self, input, ctx=None):
        return self.fc(input)


class Sum(Node):
    """Adds what its predecessors produced."""

    def forward(self, input, ctx):
        return sum(input.values())


def small_graph() -> Graph:
    return Graph.somatize(
        Lin().named("enc") >> (Lin().named("left") | Lin().named("right")) >> Sum().named("join")
    )


class FakeInside:
    """Anything with to_json() is taken as an Inside."""

    def __init__(self, data):
        self.data = data

    def to_json(self):
        return self.data


def boxes(svg: str) -> dict[str, tuple[float, float, float, float]]:
    """Every node's and layer's box in a drawing, by its id: (x, y, w, h)."""
    out = {}
    for g in ET.fromstring(svg).iter(f"{SVG}g"):
        key = g.get("data-id", "")
        if key.startswith(("n:", "l:")):
            out[key] = tuple(float(v) for v in g.get("data-box").split())
    return out


def bundled(page: str) -> dict[str, str]:
    """The browser halves a saved page carries, by name (each inlined, base64)."""
    found = re.findall(r'<script type="text/plain" data-smz-module="(\w+)">([^<]*)</script>', page)
    return {name: base64.b64decode(code).decode() for name, code in found}


def pictured(html: str) -> str:
    """The SVG a face holds as an image (a data URI)."""
    return base64.b64decode(
        re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', html).group(1)
    ).decode()


def overlap(a, b) -> bool:
    return (
        a[0] < b[0] + b[2] - 0.5
        and b[0] < a[0] + a[2] - 0.5
        and a[1] < b[1] + b[3] - 0.5
        and b[1] < a[1] + a[3] - 0.5
    )


# -- graph figure -------------------------------------------------------------------------
def test_a_graph_draws_from_its_plan_and_its_bundle_carries_a_static_face():
    g = small_graph()
    fig = g.figure()
    assert isinstance(fig, GraphFigure)
    assert [n["id"] for n in fig.plan["nodes"]] == ["enc", "left", "right", "join"]
    assert fig.plan["edges"] == [list(e) for e in g.edges()]
    data, _ = g._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == repr(g)
    face = data["text/html"]
    assert face.startswith('<div class="smz-face"') and face.endswith("<!--/smz-face-->")
    # the same drawing, as an image a sanitizer keeps (less what only a live view reads)
    still = ET.fromstring(pictured(face))
    texts = [t.text for t in still.iter(f"{SVG}text")]
    assert [t.text for t in ET.fromstring(fig.svg()).iter(f"{SVG}text")] == texts
    assert {"enc", "left", "right", "join"} <= set(texts) and not list(still.iter(f"{SVG}title"))
    data, _ = fig._repr_mimebundle_()
    assert data["text/plain"] == "graph: 4 nodes (enc, left, right, join)"


def test_insides_open_by_default_and_are_taken_as_objects_or_dicts():
    g = small_graph()
    fig = g.figure(inside={"enc": FakeInside(fd.inside_linear(True)), "left": fd.inside_linear(0)})
    assert fig.opened == ["enc", "left"]
    assert [layer["path"] for layer in fig.inside["enc"]["layers"]] == ["0", "1"]
    assert {"l:enc:0", "l:enc:1", "l:left:0"} <= set(boxes(fig.svg()))
    closed = graph_figure(g, inside={"enc": fd.inside_linear(True)}, opened=[])
    assert closed.opened == [] and "l:enc:0" not in boxes(closed.svg())
    assert 'data-click="opened enc"' in closed.svg()  # a click opens it


def test_the_real_architecture_is_drawn_with_its_parameters():
    g = small_graph()
    from somatize.torch import architecture

    fig = g.figure(inside=architecture(g, torch.randn(2, 4)))
    layer = fig.inside["enc"]["layers"][0]
    assert layer["kind"] == "learned" and layer["shape"] == [2, 4] and layer["params"] == 20
    texts = [t.text for t in ET.fromstring(fig.svg()).iter(f"{SVG}text")]
    assert "enc" in texts and any(t and "20 params" in t for t in texts)


def test_insides_and_colours_for_nodes_it_does_not_have_are_refused():
    g = small_graph()
    with pytest.raises(ValueError, match=r"'nope'.*not in this graph.*enc, left, right, join"):
        g.figure(inside={"nope": fd.inside_linear(True)})
    with pytest.raises(TypeError, match=r"inside\['enc'\].*'layers'"):
        g.figure(inside={"enc": {"edges": []}})
    with pytest.raises(ValueError, match=r"'elsewhere.fc'.*neither a node"):
        g.figure(colour={"elsewhere.fc": 1.0})
    with pytest.raises(TypeError, match=r"colour\['enc'\] is 'high'"):
        g.figure(colour={"enc": "high"})
    with pytest.raises(ValueError, match=r"opened= names 'join'"):
        graph_figure(g, inside={"enc": fd.inside_linear(True)}, opened=["join"])


def _fill(svg: str, key: str) -> str:
    for g in ET.fromstring(svg).iter(f"{SVG}g"):
        if g.get("data-id") == key:
            shape = g.find(f"{SVG}rect") if key.startswith("n:") else g.find(f"{SVG}path")
            return shape.get("fill")
    raise KeyError(key)


def test_colours_paint_the_drawing_and_a_refused_recolour_changes_nothing():
    g = small_graph()
    fig = g.figure(colour={"enc": 1, "left.fc": torch.tensor(2.5), "right": float("nan")})
    assert fig.colour == {"enc": 1.0, "left.fc": 2.5, "right": "nan"}
    plain = _fill(fig.svg(), "n:left")
    assert _fill(fig.svg(), "n:enc").startswith("rgb(") and _fill(fig.svg(), "n:right") == plain
    before = fig.drawing
    with pytest.raises(ValueError):
        fig.recolour({"enc": 3.0, "ghost": 1.0})
    assert fig.colour == {"enc": 1.0, "left.fc": 2.5, "right": "nan"} and fig.drawing == before
    fig.recolour({"join": 7.0}, label="grad norm")
    assert fig.colour == {"join": 7.0} and fig.colour_label == "grad norm"
    assert _fill(fig.svg(), "n:join").startswith("rgb(") and _fill(fig.svg(), "n:enc") == plain
    assert "grad norm" in fig.svg()  # the legend names what the colours are


def test_a_folded_block_is_drawn_once_and_each_copy_when_expanded():
    folded = graph_figure(fd.plan(), inside=fd.insides())
    texts = [t.text for t in ET.fromstring(folded.svg()).iter(f"{SVG}text")]
    assert any(t and t.endswith("Res  ×3") for t in texts)
    assert len(re.findall(r'class="smz-edge smz-skip"', folded.svg())) == 1  # the residual
    assert 'data-click="expanded enc:blocks.0"' in folded.svg()
    drawn = boxes(folded.svg())
    assert "l:enc:blocks.1.conv" not in drawn
    opened = graph_figure(fd.plan(), inside=fd.insides(), expanded=["enc:blocks.0"])
    drawn = boxes(opened.svg())
    assert {"l:enc:blocks.0.conv", "l:enc:blocks.1.conv", "l:enc:blocks.2.conv"} <= set(drawn)
    assert len(re.findall(r'class="smz-edge smz-skip"', opened.svg())) == 3  # one per copy
    # the copies run one after the other: the last layer of each into the first of the next
    chained = re.findall(r'data-from="([^"]+)" data-to="([^"]+)"', opened.svg())
    assert ("l:enc:blocks.0.relu", "l:enc:blocks.1.conv") in chained
    assert ("l:enc:blocks.1.relu", "l:enc:blocks.2.conv") in chained
    copies = [b for k, b in drawn.items() if k.startswith("l:enc:blocks.")]
    assert not any(overlap(a, b) for n, a in enumerate(copies) for b in copies[n + 1 :])


def test_the_drawing_is_a_real_svg_with_a_legend_and_no_box_overlaps_another(tmp_path):
    fig = graph_figure(fd.plan(), inside=fd.insides(), colour={"head": 1.0, "join": 2.0})
    root = ET.parse(fig.save_svg(tmp_path / "g.svg")).getroot()
    assert root.tag == f"{SVG}svg" and (tmp_path / "g.svg").read_text() == fig.svg()
    texts = {t.text for t in root.iter(f"{SVG}text")}
    for name in ("enc", "left", "right", "join", "head", "conv", "norm", "activation"):
        assert name in texts  # nodes, and the kinds of layer in the legend
    assert len(root.findall(f".//{SVG}path[@class='smz-edge']")) >= 11
    drawn = boxes(fig.svg())
    nodes = [b for k, b in drawn.items() if k.startswith("n:") and k != "n:enc"]
    for k, a in enumerate(nodes):
        assert not any(overlap(a, b) for b in nodes[k + 1 :])
    layers = [b for k, b in drawn.items() if k.startswith("l:enc:")]
    for k, a in enumerate(layers):
        assert not any(overlap(a, b) for b in layers[k + 1 :])


def test_200_nodes_wrap_into_rows_as_wide_as_the_room_and_none_overlap():
    fig = graph_figure(fd.chain_plan(200), width=1000)
    root = ET.fromstring(fig.svg())
    width = float(root.get("width"))
    assert 900 <= width <= 1000  # rows that fit the output area, not one 26000 px row
    drawn = boxes(fig.svg())
    assert len(drawn) == 200
    ordered = sorted(drawn.values())
    for k, a in enumerate(ordered):
        assert not any(overlap(a, b) for b in ordered[k + 1 : k + 40])
        assert a[0] >= 0 and a[0] + a[2] <= width
    fig.width = 1600  # the browser says the output area is wider: longer rows, fewer of them
    assert float(ET.fromstring(fig.svg()).get("height")) < float(root.get("height")) * 0.8


def test_a_deep_network_wraps_into_columns_that_fit_the_height():
    from somatize.torch import architecture

    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])
    fig = graph_figure(net, inside=architecture(net, torch.randn(8, 64)), height=640)
    drawn = boxes(fig.svg())
    assert len([k for k in drawn if k.startswith("l:")]) == 40
    columns = {round(b[0]) for k, b in drawn.items() if k.startswith("l:")}
    assert len(columns) >= 3  # side by side, not one 2000 px column
    assert float(ET.fromstring(fig.svg()).get("height")) < 800


def test_saved_html_is_standalone_and_offline(tmp_path):
    fig = graph_figure(fd.plan(), inside=fd.insides(), colour={"enc.conv": 1.0})
    text = fig.save_html(tmp_path / "g.html").read_text()
    assert '"blocks.0.conv"' in text and "smz-graph-svg" in text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched
    js = bundled(text)  # the browser half, inside the page
    assert list(js) == ["graph"] and len(js["graph"]) > 1000 and "render" in js["graph"]


# -- comparison ---------------------------------------------------------------------------
def test_compare_counts_parameters_keeps_measured_and_takes_a_list():
    a = Graph.somatize(Lin(4, 8).named("a") >> Lin(8, 2).named("b"))
    b = Graph.somatize(Lin(4, 2).named("a"))
    df = compare({"two": a, "one": b}, torch.randn(3, 4), measured={"two": 0.9, "one": 0.5})
    assert list(df.index) == ["two", "one"] and df.index.name == "candidate"
    assert df.loc["two", "params"] == 4 * 8 + 8 + 8 * 2 + 2
    assert df.loc["one", "params"] == 4 * 2 + 2
    assert df.loc["one", "measured"] == 0.5
    listed = compare([a, b, b], torch.randn(3, 4))
    assert list(listed.index) == ["a → b", "a", "a (2)"]
    assert listed.loc["a → b", "params"] == df.loc["two", "params"]
    with pytest.raises(ValueError, match="'three'"):
        compare({"two": a}, torch.randn(3, 4), measured={"three": 1.0})
    with pytest.raises(ValueError, match="at least one"):
        compare({}, torch.randn(3, 4))
    with pytest.raises(TypeError, match="list of graphs"):
        compare(a, torch.randn(3, 4))


def test_compare_names_the_candidate_it_cannot_look_at():
    lazy = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LazyLinear(2))
    fine = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"candidate 'lazy': .*2\.weight, 2\.bias not made yet"):
        compare({"fine": fine, "lazy": lazy}, torch.randn(3, 4))
    assert isinstance(lazy[2], nn.LazyLinear)  # left as it was
    lazy(torch.randn(3, 4))
    df = compare({"fine": fine, "lazy": lazy}, torch.randn(3, 4))
    assert df.loc["lazy", "params"] == 4 * 8 + 8 + 8 * 2 + 2


def test_compare_says_which_candidate_a_proxy_was_left_out_of():
    torch.manual_seed(0)
    relu = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    linear = nn.Sequential(nn.Linear(4, 2))  # no activation layer for naswot to read
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        df = compare({"relu": relu, "linear": linear}, torch.randn(6, 4))
    told = [str(w.message) for w in said if "naswot" in str(w.message)]
    assert told and all(t.startswith("candidate 'linear': proxies: naswot") for t in told)
    left = [w.message for w in said if w.category is ProxyLeftOut]
    assert [(w.candidate, w.proxy) for w in left] == [("linear", "naswot")]
    assert math.isnan(df.loc["linear", "proxy:naswot"])
    assert math.isfinite(df.loc["relu", "proxy:naswot"])
    # the columns are in one order whichever candidate comes first: naswot among the proxies
    first = compare({"linear": linear, "relu": relu}, torch.randn(6, 4))
    assert list(first.columns) == list(df.columns)
    assert [c for c in df.columns if c.startswith("proxy:")] == [
        "proxy:synflow",
        "proxy:zen",
        "proxy:naswot",
        "proxy:jacob_cov",
    ]


def test_the_table_says_why_a_proxy_was_left_out_in_its_cell_and_under_the_table():
    torch.manual_seed(0)
    relu = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    linear = nn.Sequential(nn.Linear(4, 2))  # no activation layer for naswot to read
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = compare({"relu": relu, "linear": linear}, torch.randn(6, 4))
    why = df.attrs["left_out"]["linear"]["proxy:naswot"]
    assert "activation layers" in why and "relu" not in df.attrs["left_out"]
    html = CompareTable(df).face()
    cell = re.search(r'<tr data-row="linear">.*?(<td data-col="proxy:naswot"[^>]*>)', html).group(1)
    assert f"left out: {why}" in cell
    note = re.search(r'<div class="smz-left-out".*?</div></div>', html).group(0)
    assert "linear" in note and "naswot" in note and why in note
    # left out of every candidate, a proxy has no column, and the note still says why
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = compare({"linear": linear}, torch.randn(6, 4))
    assert "proxy:naswot" not in alone.columns and why in CompareTable(alone).face()
    # a table of what compare() did not make has no such note
    assert "smz-left-out" not in CompareTable(_table()).face()


def test_compare_holds_probe_summaries_and_proxies_and_loss_proxies_with_a_target():
    torch.manual_seed(0)
    a = Graph.somatize(Lin(4, 8).named("a") >> Lin(8, 3).named("b"))
    b = Graph.somatize(Lin(4, 3).named("a"))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    bare = compare({"two": a, "one": b}, x)
    assert any(c.startswith("probe:") for c in bare.columns)
    assert "proxy:synflow" in bare.columns and "proxy:snip" not in bare.columns
    full = compare({"two": a, "one": b}, x, target=y, objective=nn.functional.cross_entropy)
    assert "proxy:snip" in full.columns
    assert full.loc["two", "proxy:synflow"] == pytest.approx(bare.loc["two", "proxy:synflow"])
    scores = full[[c for c in full.columns if c.startswith("proxy:")]]
    assert scores.notna().all().all()


def _table(n=4, probe=0):
    rows = ["w", "x", "y", "z", "v", "u"][:n]
    data = {"params": [10, 20, 30, 40, 50, 60][:n], "proxy:a": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0][:n]}
    data["proxy:b"] = [-6.5e6, -6.4e6, 0.7062, float("-inf"), 1e-5, 2][:n]
    for k in range(probe):
        data[f"probe:zero_{k}"] = [0.1] * n
    data["probe:zero_frac_max"] = [0.1, 0.99, 0.2, 0.3, 0.1, 0.1][:n]
    return pd.DataFrame(data, index=rows)


def test_the_table_puts_measured_next_to_the_names_and_ranks_and_correlates():
    table = CompareTable(_table(), measured={"w": 0.1, "x": 0.2, "y": 0.3, "z": 0.4})
    cols = table.table["columns"]
    assert cols[0] == "measured" and cols[1] == "params"
    assert cols.index("proxy:a") < cols.index("probe:zero_frac_max")
    assert table.sort_by == "measured" and table.table["correlations"]["proxy:a"] == pytest.approx(
        1.0
    )
    html = table.face()
    rows = re.findall(r'<tr data-row="(\w)"', html)
    assert rows == ["z", "y", "x", "w"]  # by measured, best first
    # proxy:a ranks as measured does: its best cell green, its worst red
    best = re.search(r'<tr data-row="z">.*?data-col="proxy:a"[^>]*style="([^"]*)"', html).group(1)
    worst = re.search(r'<tr data-row="w">.*?data-col="proxy:a"[^>]*style="([^"]*)"', html).group(1)
    assert "rgba(47,158,68" in best and "rgba(224,49,49" in worst
    # the probe's zero fraction of 0.99 is what the health verdict calls DEAD: tinted, said
    row = r'<tr data-row="x">.*?(<td data-col="probe:zero_frac_max"[^>]*>)'
    cell = re.search(row, html).group(1)
    assert "flagged DEAD" in cell and "background" in cell
    assert "ρ with measured" in html and 'class="smz-scatter"' in html
    # its SVG file is well-formed XML, the scatter's images inside the foreignObject included
    assert ET.fromstring(table.svg()).find(f"{SVG}foreignObject") is not None
    with pytest.raises(ValueError, match="'acc' is not a column"):
        CompareTable(_table(), measured="acc")
    with pytest.raises(TypeError, match="DataFrame"):
        CompareTable({"a": 1})


def test_a_proxy_of_minus_infinity_is_coloured_the_worst_of_its_column():
    # naswot's and zen's log 0 (every unit dead) is the worst score there is, and says so
    df = pd.DataFrame({"proxy:naswot": [157.0, float("-inf"), 100.0]}, index=list("abc"))
    html = CompareTable(df).face()

    def colour(row):
        cell = rf'<tr data-row="{row}">.*?<td data-col="proxy:naswot"[^>]*style="([^"]*)"'
        return re.search(cell, html).group(1)

    assert "rgba(224,49,49" in colour("b") and "rgba(47,158,68" in colour("a")
    assert "rgba(224,49,49" not in colour("c")


def test_every_number_in_the_table_is_written_one_way_and_every_column_explained():
    table = CompareTable(_table(), measured={"w": 0.1, "x": 0.2, "y": 0.3, "z": 0.4})
    body = table.face().split("<tbody>")[1].split("</tbody>")[0]
    cells = re.findall(r'<td data-col="proxy:b"[^>]*>([^<]*)</td>', body)
    assert sorted(cells) == sorted(["−6.5M", "−6.4M", "0.706", "−∞"])
    other = CompareTable(pd.DataFrame({"proxy:c": [1234, 3.2e-4, 0, 999.96]}, index=list("abcd")))
    body = other.face().split("<tbody>")[1]
    assert sorted(re.findall(r'<td data-col="proxy:c"[^>]*>([^<]*)</td>', body)) == sorted(
        ["1.23k", "3.2e-4", "0", "1k"]
    )
    for column in table.table["columns"]:
        assert re.search(rf'<th data-col="{re.escape(column)}"[^>]*title="[^"]+"', table.face())


def test_a_number_of_a_thousand_trillions_or_more_is_written_with_its_exponent():
    # an exploding loss, a grad norm past any scale, a signal gain of 1e45
    values = [1.234e15, 5e15, -2e16, 999.6e12, 1e45, 9.9996e299]
    table = CompareTable(pd.DataFrame({"proxy:v": values}, index=list("abcdef")))
    body = table.face().split("<tbody>")[1]
    cells = re.findall(r'<td data-col="proxy:v"[^>]*>([^<]*)</td>', body)
    assert sorted(cells) == sorted(["1.23e15", "5e15", "−2e16", "1e15", "1e45", "1e300"])


def test_a_count_past_what_a_float_holds_is_written_as_infinity_in_a_table():
    # (an object column, as pandas 3 makes of them; pandas 2, Python 3.10's, would refuse them)
    tokens = pd.Series([10**400, -(10**400), 7], index=list("abc"), dtype=object)
    table = CompareTable(pd.DataFrame({"tokens": tokens}))
    body = table.face().split("<tbody>")[1]
    cells = re.findall(r'<td data-col="tokens"[^>]*>([^<]*)</td>', body)
    assert sorted(cells) == sorted(["∞", "−∞", "7"])


def test_a_wide_table_keeps_to_1400_px_and_hides_the_rest_behind_a_toggle():
    wide = _table(6, probe=24)
    table = CompareTable(wide, measured=dict(zip(wide.index, range(6), strict=True)))
    hidden = table.hidden()
    assert hidden and all(c.startswith("probe:") for c in hidden)
    assert 'class="smz-toggle" data-group="probe"' in table.face()
    table.shown = ["probe"]
    assert table.hidden() == [] and "smz-toggle" not in table.face()
    # a candidate the health verdict flags says so in view: its flags are never tucked away
    wide["probe:flags"] = ["", "DEAD@body.1", "", "", "", ""]
    flagged = CompareTable(wide, measured=dict(zip(wide.index, range(6), strict=True)))
    assert flagged.hidden() and "probe:flags" not in flagged.hidden()
    assert "probe:flags" in CompareTable(_table(6, probe=24).assign(**{"probe:flags": ""})).hidden()


def test_bundles_are_built_and_shipped(tmp_path):
    figures = {
        "graph": graph_figure(small_graph()),
        "audit": LiveAudit(interval=0.05),
        "table": CompareTable(_table()),
    }
    for name, fig in figures.items():
        page = fig.save_html(tmp_path / f"{name}.html").read_text()
        js = bundled(page)[name]
        assert len(js) > 1000 and "export" in js and "render" in js
        assert f".smz-{name} " in re.search(r"<style>(.*?)</style>", page, re.S).group(1)


def test_the_readmes_three_figures_run_and_its_pictures_and_badge_are_there():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("pictures", root / "docs" / "pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    readme = (root / "README.md").read_text()
    assert len(pictures.blocks(readme)[1].strip().splitlines()) <= 10  # figures in ten lines
    made = pictures.figures(readme)
    assert set(made) == {"graph", "audit", "table"}
    assert len(made["audit"].frame()) > 0 and {"n:encoder", "n:head"} <= set(
        boxes(made["graph"].svg())
    )
    for kind in made:
        assert (
            f"(docs/pictures/{kind}.svg)" in readme
            and (root / "docs" / "pictures" / f"{kind}.svg").exists()
        )
    assert pictures.main(["--check"]) == 0  # the badge is the one pyproject.toml sets
    assert "OWNER" not in readme


def test_a_tied_weight_is_counted_once_and_attention_axes_are_heads_and_sequence():
    from _nodes import Tied

    from somatize.torch import architecture

    net = Tied()
    inside = architecture(net, torch.tensor([[1, 2, 3]]))
    total = sum(p.numel() for p in net.parameters())
    fig = graph_figure(net, inside=inside)  # a bare module is a graph of one node
    texts = [t.text for t in ET.fromstring(fig.svg()).iter(f"{SVG}text")]
    assert total == 64 and any(t and f"{total} params" in t for t in texts)  # not 108
    layer = {
        "kind": "attention",
        "label": "SelfAttention",
        "shape": [2, 8, 16],
        "params": 0,
        "times": 1,
        "repeats": [],
    }
    attn = {
        "layers": [
            {**layer, "path": "attn", "block": None},
            {**layer, "path": "attn.sdpa", "label": "sdpa", "shape": [2, 2, 8, 8], "block": "attn"},
            {
                **layer,
                "path": "attn.view",
                "kind": "shaping",
                "label": "view",
                "shape": [2, 8, 2, 8],
                "block": "attn",
            },
            {
                **layer,
                "path": "conv",
                "kind": "conv",
                "label": "Conv2d",
                "shape": [2, 3, 8, 8],
                "block": None,
            },
        ],
        "edges": [["attn.sdpa", "attn.view"], ["attn.view", "conv"]],
    }
    g = Graph.somatize(Node.of(nn.Identity()).named("enc"))
    texts = [
        t.text
        for t in ET.fromstring(graph_figure(g, inside={"enc": attn}).svg()).iter(f"{SVG}text")
    ]
    assert "2 batch · 2 heads · 8 seq · 8 dim" in texts  # attention's own output
    assert "2 batch · 8 d1 · 2 d2 · 8 d3" in texts  # inside attention: not an image
    assert "2 batch · 3 ch · 8 h · 8 w" in texts


def test_a_1d_convs_channels_stay_on_dim_1_through_what_follows_it_and_a_sequences_last():
    """(N, C, L) out of a Conv1d is channels then length after its norm, activation and
    dropout too; a linear layer's (N, T, D), and GPT-2's Conv1D's (a linear layer), is not."""
    from transformers.pytorch_utils import Conv1D

    from somatize.torch import architecture

    def texts(net, x):
        svg = graph_figure(net, inside=architecture(net, x)).svg()
        return [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if t.text and "·" in t.text]

    conv = nn.Sequential(nn.Conv1d(2, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout())
    assert texts(conv, torch.randn(4, 2, 20))[1:] == ["4 batch · 8 ch · 20 len"] * 4
    seq = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), Conv1D(5, 6), nn.LayerNorm(5))
    assert texts(seq, torch.randn(4, 20, 8))[1:] == [
        "4 batch · 20 len · 6 dim",
        "4 batch · 20 len · 6 dim",
        *["4 batch · 20 len · 5 dim"] * 2,
    ]


def test_axes_are_named_by_the_audits_rule_a_local_response_norm_and_a_pool_included():
    """Channels then length where the audit measures channels (tests/test_audit.py runs this
    net): after a LocalResponseNorm as after a Conv1d, and out of a pool after a Linear."""
    from _nodes import Listen

    from somatize.torch import architecture

    net = Listen()
    svg = graph_figure(net, inside=architecture(net, torch.randn(4, 2, 20))).svg()
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if t.text and "·" in t.text]
    assert texts[1:] == [
        *["4 batch · 8 ch · 20 len"] * 3,
        "4 batch · 20 len · 6 dim",
        "4 batch · 6 ch · 10 len",
    ]


def test_a_layer_is_drawn_by_what_it_computes_with_not_by_its_name(tmp_path):
    """GPT-2's Conv1D is a linear layer (its kind says so): drawn as one, never as a conv."""
    from transformers.pytorch_utils import Conv1D

    from somatize.torch import architecture

    g = Graph.somatize(nn.Sequential(Conv1D(8, 4), nn.ReLU()))
    svg = (
        graph_figure(g, inside=architecture(g, torch.randn(2, 4), depth=1))
        .save_svg(tmp_path / "g.svg")
        .read_text()
    )
    assert "smz-kind-linear" in svg and "smz-kind-conv" not in svg


def test_a_node_that_is_one_module_is_drawn_at_its_own_name():
    from somatize.torch import architecture

    enc, head = Node.of(nn.Linear(4, 4)).named("enc"), Node.of(nn.Linear(4, 3)).named("head")
    g = Graph.somatize(enc >> head)
    fig = g.figure(inside=architecture(g, torch.randn(2, 4)), colour={"head": 1.0})
    tips = [t.text for t in ET.fromstring(fig.svg()).iter(f"{SVG}title")]
    layer = next(t for t in tips if t.startswith("Linear 4→3"))
    assert "path: head\n" in layer and "head." not in layer
    # the node's number paints its one layer too: a probe's "head" lands on that box
    assert _fill(fig.svg(), "l:head:").startswith("rgb(")
    assert not _fill(fig.svg(), "l:enc:").startswith("rgb(")


def _points(d: str, steps: int = 16) -> list[tuple[float, float]]:
    """Points along an SVG path of M, L, Q and C commands, each curve sampled."""
    out: list[tuple[float, float]] = []
    for op, args in re.findall(r"([MLQC])([^MLQC]*)", d):
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", args)]
        pts = list(zip(nums[::2], nums[1::2], strict=True))
        if op in "ML":
            out += pts
            continue
        ctrl = [out[-1], *pts]
        for k in range(1, steps + 1):
            t, ps = k / steps, ctrl
            while len(ps) > 1:  # de Casteljau
                pairs = zip(ps, ps[1:], strict=False)
                ps = [(a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])) for a, b in pairs]
            out.append(ps[0])
    return out


class Attn(nn.Module):
    """Three projections side by side, then one out: a block wider and taller than a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.mix(self.q(x) * self.k(x) + self.v(x)))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.attn = Attn()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.attn(self.norm(x)))


def test_a_residual_goes_round_the_tall_block_beside_it_and_through_no_layer():
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(nn.Sequential(nn.Linear(4, 4), Residual())))
    svg = g.figure(inside=architecture(g, torch.randn(2, 4))).svg()
    drawn = {k: v for k, v in boxes(svg).items() if k.startswith("l:")}
    skip = r'class="smz-edge smz-skip" d="([^"]+)"[^>]*data-from="([^"]+)" data-to="([^"]+)"'
    skips = re.findall(skip, svg)
    assert skips
    for d, src, dst in skips:
        for x, y in _points(d):
            inside = [
                k
                for k, (bx, by, w, h) in drawn.items()
                if bx + 1 < x < bx + w - 1 and by + 1 < y < by + h - 1 and k not in (src, dst)
            ]
            assert not inside, (x, y, inside)


class Patches(nn.Module):
    """A ViT's patch embedding: a strided conv, its grid flattened, then transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 4, stride=4)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.proj(x).flatten(2).transpose(1, 2))


def test_a_conv_grid_flattened_keeps_its_channels_named_first():
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(Patches()))
    svg = g.figure(inside=architecture(g, torch.randn(2, 3, 8, 8))).svg()
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "2 batch · 8 ch · 2 h · 2 w" in texts  # the conv
    assert "2 batch · 8 ch · 4 len" in texts  # its grid flattened: 8 channels of 4 places
    assert "2 batch · 4 len · 8 dim" in texts  # the linear, on the patches as a sequence


class SelfOut(nn.Module):
    """BERT's self-output: a projection, then the residual added and normed."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, h, x):
        return self.norm(self.dense(h) + x)


class Attention(nn.Module):
    """BERT's attention: a wide block, then one that adds what entered both."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.out = Attn(), SelfOut()

    def forward(self, x):
        return self.out(self.attn(x), x)


class Layer(nn.Module):
    """A transformer layer: attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.up, self.act, self.down = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(self.act(self.up(self.attention(x))))


def _drawn(module: nn.Module, x: torch.Tensor, **kw) -> tuple[str, dict, list]:
    """A module's figure: its SVG, its boxes (blocks' frames too) and its edges (d, from, to)."""
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(module))
    svg = g.figure(inside=architecture(g, x), **kw).svg()
    frames = {
        g.get("data-id"): tuple(float(v) for v in g.get("data-box").split())
        for g in ET.fromstring(svg).iter(f"{SVG}g")
        if g.get("data-box")
    }
    edge = r'class="smz-edge[^"]*" d="([^"]+)"[^>]*data-from="([^"]+)" data-to="([^"]+)"'
    return svg, frames, re.findall(edge, svg)


def test_a_block_is_drawn_down_one_column_however_low_the_room():
    _, drawn, edges = _drawn(nn.Sequential(Layer(), Layer()), torch.randn(2, 3, 4), height=400)
    assert any(k.startswith("b:") for k in drawn)
    inner = [(a, b) for _, a, b in edges if a.startswith("l:") and b.startswith("l:")]
    assert len(inner) > 10
    for a, b in inner:  # every edge inside the folded layer goes down, none round a column
        assert drawn[b][1] >= drawn[a][1] + drawn[a][3], (a, b)


class Closed(nn.Module):
    """A block past the depth drawn: a plain container inside it is closed into one box."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.block(x))


@pytest.mark.parametrize("block", [Attention, Closed])
def test_an_edge_into_a_block_keeps_off_the_frames_and_boxes_it_passes(block):
    _, drawn, edges = _drawn(nn.Sequential(nn.Linear(4, 4), block()), torch.randn(2, 4))
    frames = [v for k, v in drawn.items() if k.startswith("b:")]
    assert frames and edges
    for d, src, dst in edges:
        points = _points(d)
        for x, y, w, _ in frames:  # no run along a frame's top border (a crossing is fine)
            along = [
                abs(q[0] - p[0])
                for p, q in zip(points, points[1:], strict=False)
                if all(x < r[0] < x + w and abs(r[1] - y) < 4 for r in (p, q))
            ]
            assert sum(along) < 12, (src, dst, sum(along))
        for px, py in points:  # beside a box or frame it passes, a gap as between boxes
            for k, (x, y, w, h) in drawn.items():
                beside = y + 1 < py < y + h - 1 and not x < px < x + w
                if k not in (src, dst) and beside:
                    assert min(abs(px - x), abs(px - x - w)) >= 12, (src, dst, k, px, py)


def test_a_closed_plain_container_is_named_by_where_it_is():
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(nn.Sequential(nn.Linear(4, 4), Closed())))
    inside = architecture(g, torch.randn(2, 4), most=5)
    svg = g.figure(inside=inside).svg()
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "block: Sequential" in texts and "Sequential" not in texts


class Twice(nn.Module):
    """Two 3×3 convs, each with a ReLU after it: a U-Net's step."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(i, o, 3, padding=1), nn.Conv2d(o, o, 3, padding=1)

    def forward(self, x):
        return nn.functional.relu(self.b(nn.functional.relu(self.a(x))))


class UNet(nn.Module):
    """Down twice, up twice, each level's output concatenated into the way up."""

    def __init__(self) -> None:
        super().__init__()
        self.inc, self.down1, self.down2 = Twice(3, 4), Twice(4, 8), Twice(8, 8)
        self.up1, self.up2, self.out = Twice(16, 4), Twice(8, 4), nn.Conv2d(4, 2, 1)
        self.pool, self.grow = nn.MaxPool2d(2), nn.Upsample(scale_factor=2)

    def forward(self, x):
        a = self.inc(x)
        b = self.down1(self.pool(a))
        c = self.down2(self.pool(b))
        d = self.up1(torch.cat([self.grow(c), b], 1))
        return self.out(self.up2(torch.cat([self.grow(d), a], 1)))


class Dense(nn.Module):
    """A DenseNet block: each layer reads every output before it, concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4 + 2 * k, 2, 3, padding=1) for k in range(4))

    def forward(self, x):
        seen = [x]
        for conv in self.convs:
            seen.append(torch.relu(conv(torch.cat(seen, 1))))
        return torch.cat(seen, 1)


def test_skip_connections_run_beside_one_column_and_leave_their_source_as_one_line():
    # a U-Net taller than the room: read down one column, each skip beside it, never round
    # the columns of a wrapped drawing (down, across the bottom, over the top, down again)
    _, drawn, edges = _drawn(UNet(), torch.randn(1, 3, 8, 8), height=640)
    assert sum(k.startswith("l:") for k in drawn) > 25
    assert sum(b.startswith("l:") for _, _, b in edges) > 25
    for _, a, b in edges:
        assert drawn[b][1] >= drawn[a][1] + drawn[a][3], (a, b)
    assert float(ET.fromstring(_drawn(UNet(), torch.randn(1, 3, 8, 8))[0]).get("width")) < 500
    # a DenseNet block: what one layer sends to every concat after it leaves as one line
    _, drawn, edges = _drawn(Dense(), torch.randn(1, 4, 8, 8), height=400)
    starts: dict[str, set] = {}
    for d, a, b in edges:
        assert drawn[b][1] >= drawn[a][1] + drawn[a][3], (a, b)
        starts.setdefault(a, set()).add(tuple(round(v) for v in _points(d)[0]))
    fanned = [a for _, a, _ in edges if sum(e[1] == a for e in edges) > 2]
    assert fanned and all(len(starts[a]) == 1 for a in fanned), starts


def test_an_open_nodes_colour_is_on_its_title_and_its_frame_stays_light():
    # a coloured open node painted whole would take the contrast from its edges and frames
    colour = {"enc": 0.0, "enc.conv": 1.0, "head": 0.5}
    svg = graph_figure(fd.plan(), inside=fd.insides(), colour=colour).svg()
    root = ET.fromstring(svg)
    enc = next(g for g in root.iter(f"{SVG}g") if g.get("data-id") == "n:enc")
    frame, head = enc.findall(f"{SVG}rect")[:2]
    assert not frame.get("fill").startswith("rgb(") and head.get("fill").startswith("rgb(")
    x, y, w, _ = (float(frame.get(k)) for k in ("x", "y", "width", "height"))
    assert float(head.get("width")) > w - 4 and float(head.get("height")) < 48  # its title
    title = next(t for t in enc.iter(f"{SVG}text") if t.text == "enc")
    assert title.get("fill") == "#fff"  # readable on the dark end of the scale
    assert _fill(svg, "l:enc:conv").startswith("rgb(")  # its layers take their own colours
    assert _fill(svg, "n:head").startswith("rgb(")  # a closed node is painted whole


class SharedEncoder(nn.Module):
    """One encoder called on two inputs: the same weights twice."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, a, b):
        return self.head(torch.cat([self.enc(a), self.enc(b)], -1))


def test_a_module_called_twice_says_so_on_each_box_and_names_the_other():
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(SharedEncoder()).named("net"))
    svg = g.figure(inside=architecture(g, (torch.randn(2, 4), torch.randn(2, 4)))).svg()
    tips = {
        g.get("data-id"): g.find(f"{SVG}title").text
        for g in ET.fromstring(svg).iter(f"{SVG}g")
        if g.get("data-id", "").startswith("l:")
    }
    first = next(t for k, t in tips.items() if k.startswith("l:net:enc.0") and "#" not in k)
    again = next(t for k, t in tips.items() if k.startswith("l:net:enc.0#"))
    assert first.startswith("Linear 4→8 · call 1/2") and again.startswith("Linear 4→8 · call 2/2")
    assert "same module as: net.enc.0#2 (weights shared)" in first
    assert "same module as: net.enc.0 (weights shared)" in again
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "Linear 4→8 · call 2/2" in texts  # seen on the picture, not only on hover
    relu = next(t for k, t in tips.items() if k.startswith("l:net:enc.1#"))
    assert relu.endswith("same module as: net.enc.1")  # no weights to share
    assert not any("call" in t for k, t in tips.items() if "head" in k)


class EncoderDecoder(nn.Module):
    """A linear layer and a block held under two names each, in the encoder and the decoder."""

    def __init__(self) -> None:
        super().__init__()
        lin, block = nn.Linear(4, 4), Mlp()
        self.enc = nn.Sequential(lin, nn.ReLU(), block)
        self.dec = nn.Sequential(lin, nn.Tanh(), block)

    def forward(self, x):
        return self.dec(self.enc(x))


class Mlp(nn.Module):
    """Two linear layers, a GELU between."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def _tips(svg: str) -> dict[str, str]:
    """Every box's tooltip, by its id."""
    return {
        g.get("data-id"): g.find(f"{SVG}title").text
        for g in ET.fromstring(svg).iter(f"{SVG}g")
        if g.get("data-id") and g.find(f"{SVG}title") is not None
    }


def test_a_module_held_under_two_names_is_marked_as_one_module_called_twice():
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(EncoderDecoder()).named("net"))
    svg = g.figure(inside=architecture(g, torch.randn(2, 4))).svg()
    tips = _tips(svg)
    first, again = tips["l:net:enc.0"], tips["l:net:dec.0"]
    assert first.startswith("Linear 4→4 · call 1/2") and again.startswith("Linear 4→4 · call 2/2")
    assert "same module as: net.dec.0 (weights shared)" in first
    assert "same module as: net.enc.0 (weights shared)" in again
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "Linear 4→4 · call 2/2" in texts  # on the picture, not only on hover
    block = next(t for k, t in tips.items() if k.startswith("b:net:dec.2"))
    assert "same module as: net.enc.2 (weights shared)" in block  # a block held twice too
    assert tips["l:net:dec.2.a"].startswith("Linear 4→16 · call 2/2")
    assert "same module" not in tips["l:net:dec.1"]  # the decoder's own Tanh
    # two modules holding one weight (GPT-2's head and its token embedding): each names the
    # other, and neither is a call of the other
    from _nodes import Tied

    g = Graph.somatize(Node.of(Tied()))
    tips = _tips(g.figure(inside=architecture(g, torch.tensor([[1, 2, 3]]))).svg())
    assert tips["l:tied:lm_head"].endswith("weights shared with: tied.wte")
    assert tips["l:tied:wte"].endswith("weights shared with: tied.lm_head")
    assert "shared" not in tips["l:tied:body"] and "call" not in tips["l:tied:lm_head"]


def test_a_closed_containers_tooltip_says_what_it_holds():
    from somatize.torch import architecture

    g = Graph.somatize(Node.of(nn.Sequential(nn.Linear(4, 4), Closed())).named("net"))
    tips = _tips(g.figure(inside=architecture(g, torch.randn(2, 4), most=5)).svg())
    held = tips["l:net:1.block"].replace("\u00a0", " ")  # (each kept on one line)
    assert held.endswith("holds: 0: Linear, 1: ReLU, 2: Linear")
    assert "holds" not in tips["l:net:0"]
    many = nn.Sequential(nn.Linear(4, 4), nn.Sequential(*(nn.Linear(4, 4) for _ in range(12))))
    g = Graph.somatize(Node.of(many).named("net"))
    tips = _tips(g.figure(inside=architecture(g, torch.randn(2, 4), most=2)).svg())
    listed = ", ".join(f"{k}:\u00a0Linear" for k in range(8))
    assert tips["l:net:1"].endswith(f"holds: {listed}, … and 4 more")


def _end(svg: str, src: str, dst: str) -> tuple[float, float]:
    """Where the edge from `src` to `dst` ends."""
    edge = rf'class="smz-edge[^"]*" d="([^"]+)"[^>]*data-from="{src}" data-to="{dst}"'
    return _points(re.search(edge, svg).group(1))[-1]


def _on_top(point, box) -> bool:
    x, y, w, _ = box
    return x < point[0] < x + w and abs(point[1] - y) < 2


def test_an_edge_into_an_open_node_reaches_the_layer_that_reads_what_it_is_given():
    from somatize.torch import architecture

    a = Node.of(nn.Sequential(nn.Linear(4, 8), nn.ReLU())).named("a")
    b = Node.of(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))).named("b")
    g = Graph.somatize(a >> b >> Node.of(nn.Linear(2, 2)).named("c"))
    inside = architecture(g, torch.randn(2, 4))
    svg = g.figure(inside=inside).svg()
    drawn = boxes(svg)
    assert _on_top(_end(svg, "n:a", "n:b"), drawn["l:b:0"])  # into its first layer, from above
    edge = r'class="smz-edge[^"]*" d="([^"]+)"[^>]*data-from="n:a" data-to="n:b"'
    x, y, _, _ = drawn["n:b"]
    inside_b = [q for q in _points(re.search(edge, svg).group(1)) if q[0] > x + 1]
    assert inside_b and all(q[1] > y + 44 for q in inside_b)  # clear of its title and subtitle
    assert _on_top(_end(svg, "n:b", "n:c"), drawn["l:c:"])  # a node that is one layer
    layers = [v for k, v in drawn.items() if k.startswith("l:")]
    assert not any(overlap(p, q) for p, q in itertools.combinations(layers, 2))
    closed = g.figure(inside=inside, opened=["a"]).svg()  # b closed: its frame's side
    x, y, _, h = boxes(closed)["n:b"]
    end = _end(closed, "n:a", "n:b")
    assert abs(end[0] - x) < 2 and y < end[1] < y + h
    # more than one layer reads it: the edge reaches the input box they start from, also
    # where the node is one of two branches
    stem = Node.of(nn.Conv2d(3, 4, 1)).named("stem")
    conv = Node.of(nn.Sequential(nn.Conv2d(4, 12, 3, padding=1), nn.ReLU())).named("conv")
    g = Graph.somatize(stem >> (Node.of(Dense()).named("dense") | conv) >> Sum().named("sum"))
    svg = g.figure(inside=architecture(g, torch.randn(1, 3, 8, 8))).svg()
    assert 'class="smz-group"' in svg  # the two drawn in a frame
    drawn = {
        k: tuple(float(v) for v in e.get("data-box").split())
        for e in ET.fromstring(svg).iter(f"{SVG}g")
        if (k := e.get("data-id", "")).startswith(("n:", "l:", "i:"))
    }
    assert _on_top(_end(svg, "n:stem", "n:dense"), drawn["i:dense"])
    assert _on_top(_end(svg, "n:stem", "n:conv"), drawn["l:conv:0"])


def _start(svg: str, src: str, dst: str) -> tuple[float, float]:
    """Where the edge from `src` to `dst` starts."""
    edge = rf'class="smz-edge[^"]*" d="([^"]+)"[^>]*data-from="{src}" data-to="{dst}"'
    return _points(re.search(edge, svg).group(1))[0]


def _on_bottom(point, box) -> bool:
    x, y, w, h = box
    return x < point[0] < x + w and abs(point[1] - y - h) < 2


def _on_side(point, box) -> bool:
    """Whether `point` is on the right side of `box` (where an edge leaves a closed node)."""
    x, y, w, h = box
    return abs(point[0] - x - w) < 2 and y < point[1] < y + h


class FirstToken(nn.Module):
    """A classifier on the first token of the hidden states an encoder gave back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 3)

    def forward(self, out):
        return self.fc(out.last_hidden_state[:, 0])


def test_an_edge_out_of_an_open_node_leaves_from_the_layer_that_gives_its_output():
    from models import zoo
    from transformers import BertModel

    from somatize.torch import architecture

    case = zoo.bert()
    encoder = BertModel(case.model.config, add_pooling_layer=False)  # gives its last LayerNorm's
    g = Graph.somatize(Node.of(encoder).named("enc") >> Node.of(FirstToken()).named("head"))
    inside = architecture(g, case.example)
    svg = g.figure(inside=inside).svg()
    drawn = boxes(svg)
    start, end = _start(svg, "n:enc", "n:head"), _end(svg, "n:enc", "n:head")
    assert _on_bottom(start, drawn["l:enc:encoder.layer.0.output.LayerNorm"])  # its block ×2
    assert _on_top(end, drawn["l:head:fc"])
    edge = r'class="smz-edge[^"]*" d="([^"]+)"[^>]*data-from="n:enc" data-to="n:head"'
    layers = {k: v for k, v in drawn.items() if k.startswith("l:")}
    for px, py in _points(re.search(edge, svg).group(1)):  # through no other layer
        assert not [
            k
            for k, (x, y, w, h) in layers.items()
            if x + 1 < px < x + w - 1 and y + 1 < py < y + h - 1
        ]
    # unfolded: from the second copy's, which reads the first copy's
    svg = g.figure(inside=inside, expanded=["enc:encoder.layer.0"]).svg()
    assert _on_bottom(
        _start(svg, "n:enc", "n:head"), boxes(svg)["l:enc:encoder.layer.1.output.LayerNorm"]
    )
    into = 'data-from="l:enc:encoder.layer.0.output.LayerNorm" data-to="l:enc:encoder.layer.1.attention.self.query"'
    assert into in svg
    # the block closed (past `most`): from its box; the node closed: from its frame's side
    svg = g.figure(inside=architecture(g, case.example, most=4)).svg()
    assert _on_bottom(_start(svg, "n:enc", "n:head"), boxes(svg)["l:enc:encoder"])
    svg = g.figure(inside=inside, opened=["head"]).svg()
    assert _on_side(_start(svg, "n:enc", "n:head"), boxes(svg)["n:enc"])
    # with its pooler, BERT gives back last_hidden_state, then pooler_output (its Tanh's, the
    # last layer that ran): the edge leaves from what made the first
    g = Graph.somatize(Node.of(case.model).named("enc") >> Node.of(FirstToken()).named("head"))
    inside = architecture(g, case.example)
    assert inside["enc"].outputs == ["encoder.layer.0.output.LayerNorm", "pooler.activation"]
    svg = g.figure(inside=inside).svg()
    drawn = boxes(svg)
    assert _on_bottom(
        _start(svg, "n:enc", "n:head"), drawn["l:enc:encoder.layer.0.output.LayerNorm"]
    )
    assert not _on_bottom(_start(svg, "n:enc", "n:head"), drawn["l:enc:pooler.activation"])
    # a chain's last layer, sending to two branches at one point; a node that is one layer
    a = Node.of(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))).named("a")
    b, c = (
        Node.of(nn.Sequential(nn.Linear(8, 8), nn.ReLU())).named("b"),
        Node.of(nn.Linear(8, 8)).named("c"),
    )
    g = Graph.somatize(a >> (b | c) >> Sum().named("sum"))
    svg = g.figure(inside=architecture(g, torch.randn(2, 4))).svg()
    drawn = boxes(svg)
    assert _start(svg, "n:a", "n:b") == _start(svg, "n:a", "n:c")
    assert _on_bottom(_start(svg, "n:a", "n:b"), drawn["l:a:2"])
    assert _on_bottom(_start(svg, "n:b", "n:sum"), drawn["l:b:1"])
    assert _on_bottom(_start(svg, "n:c", "n:sum"), drawn["l:c:"])


def test_a_colour_past_what_a_float_holds_is_drawn_as_infinity_is():
    g = small_graph()
    huge = g.figure(colour={"enc": 10**400, "left": 1.0, "right": -(10**400), "join": 2.0})
    assert huge.colour == {"enc": "inf", "left": 1.0, "right": "-inf", "join": 2.0}
    inf = graph_figure(g, colour={"enc": math.inf, "left": 1.0, "right": -math.inf, "join": 2.0})
    assert huge.svg() == inf.svg()  # unpainted, its tooltip saying ∞, the scale from 1 to 2
    assert _fill(huge.svg(), "n:enc") == _fill(graph_figure(g).svg(), "n:enc")
    assert _fill(huge.svg(), "n:join").startswith("rgb(")
    huge.recolour({"left": 10**400})
    assert huge.colour == {"left": "inf"} and "left\ncolour: ∞" in huge.svg()
    with pytest.raises(TypeError, match=r"colour\['enc'\] is 'high'; colours are numbers"):
        huge.recolour({"enc": "high"})
    assert huge.colour == {"left": "inf"}


class LastToken(nn.Module):
    """A classifier on the logits a language model gave for its last token."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.fc = nn.Linear(vocab, 3)

    def forward(self, out):
        return self.fc(out.logits[:, -1])


class Pair(nn.Module):
    """Gives back two layers' outputs, the first made by a layer that ran before the second."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.first(x), self.second(x)


def test_an_edge_out_of_an_open_node_leaves_from_the_layer_that_made_its_output():
    from models import zoo

    from somatize.torch import architecture

    gpt2 = zoo.gpt2()  # logits (its head's, tied to the token embedding) >> a classifier
    g = Graph.somatize(
        Node.of(gpt2.model).named("lm") >> Node.of(LastToken(zoo.VOCAB)).named("head")
    )
    inside = architecture(g, gpt2.example)
    assert inside["lm"].outputs == ["lm_head"]
    svg = g.figure(inside=inside).svg()
    assert _on_bottom(_start(svg, "n:lm", "n:head"), boxes(svg)["l:lm:lm_head"])
    cnn = zoo.smallnet()  # a plain CNN: its linear head
    g = Graph.somatize(Node.of(cnn.model).named("cnn") >> Node.of(nn.Linear(5, 2)).named("out"))
    inside = architecture(g, cnn.example)
    assert inside["cnn"].outputs == ["fc"] and inside["out"].outputs == [""]
    svg = g.figure(inside=inside).svg()
    assert _on_bottom(_start(svg, "n:cnn", "n:out"), boxes(svg)["l:cnn:fc"])
    # a tuple that a Bilinear reads all of: two layers made it, so from the node's frame (its
    # side, as a closed node's), not from the first of them
    g = Graph.somatize(Node.of(Pair()).named("pair") >> Node.of(nn.Bilinear(4, 4, 2)).named("b"))
    inside = architecture(g, torch.randn(2, 4))
    assert inside["pair"].outputs == ["first", "second"]
    svg = g.figure(inside=inside).svg()
    assert _on_side(_start(svg, "n:pair", "n:b"), boxes(svg)["n:pair"])


class Pooled(nn.Module):
    """A classifier on the pooled output an encoder gave back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 2)

    def forward(self, out):
        return self.fc(out.pooler_output)


class TwoHeads(nn.Module):
    """A body and two heads on it, giving back both heads' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


class Take(nn.Module):
    """A classifier on part `k` of what it is given (`k` None: all of it, concatenated)."""

    def __init__(self, k: int | None, n: int) -> None:
        super().__init__()
        self.k, self.fc = k, nn.Linear(n, 2)

    def forward(self, pair):
        return self.fc(torch.cat(pair, -1) if self.k is None else pair[self.k])


class Second(Node):
    """The second part of what it is given: a function, holding no module to read."""

    def forward(self, input, ctx):
        return input[1]


class Crossed(Node):
    """A node holding a layer, fed by two: the second part of `p`'s and the first of `q`'s."""

    def __init__(self) -> None:
        self.fc = nn.Linear(5 + 3, 2)

    def forward(self, input, ctx):
        return self.fc(torch.cat([input["p"][1], input["q"][0]], -1))


def test_each_edge_out_of_an_open_node_leaves_from_the_layer_that_made_what_its_end_reads():
    from models import zoo

    from somatize.torch import architecture

    case = zoo.bert()  # with its pooler: last_hidden_state to one head, pooler_output to another
    norm, tanh = "encoder.layer.0.output.LayerNorm", "pooler.activation"
    g = Graph.somatize(
        Node.of(case.model).named("enc")
        >> (Node.of(FirstToken()).named("tok") | Node.of(Pooled()).named("pool"))
    )
    inside = architecture(g, case.example)
    assert inside["enc"].outputs == [norm, tanh]
    assert inside["enc"].read_by == {"tok": [norm], "pool": [tanh]}
    assert inside["tok"].read_by == {} and inside["pool"].read_by == {}  # (leaves)
    svg = g.figure(inside=inside).svg()
    drawn = boxes(svg)
    assert _on_bottom(_start(svg, "n:enc", "n:tok"), drawn[f"l:enc:{norm}"])
    assert _on_bottom(_start(svg, "n:enc", "n:pool"), drawn[f"l:enc:{tanh}"])
    # its block unfolded: the last copy's LayerNorm, and still the pooler's Tanh
    svg = g.figure(inside=inside, expanded=["enc:encoder.layer.0"]).svg()
    drawn = boxes(svg)
    last = "l:enc:encoder.layer.1.output.LayerNorm"
    assert _on_bottom(_start(svg, "n:enc", "n:tok"), drawn[last])
    assert _on_bottom(_start(svg, "n:enc", "n:pool"), drawn[f"l:enc:{tanh}"])
    # two heads on one body: each node after it reads one head's, one reads both, and what a
    # plain function reads is not seen
    g = Graph.somatize(
        Node.of(TwoHeads()).named("two")
        >> (
            Node.of(Take(0, 3)).named("first")
            | Node.of(Take(1, 5)).named("second")
            | Node.of(Take(None, 8)).named("both")
            | Second().named("fn")
        )
    )
    inside = architecture(g, torch.randn(2, 4))
    assert inside["two"].outputs == ["a", "b"]
    assert inside["two"].read_by == {"first": ["a"], "second": ["b"], "both": ["a", "b"]}
    svg = g.figure(inside=inside).svg()
    drawn = boxes(svg)
    assert _on_bottom(_start(svg, "n:two", "n:first"), drawn["l:two:a"])
    assert _on_bottom(_start(svg, "n:two", "n:second"), drawn["l:two:b"])
    x, y, w, h = drawn["n:two"]
    sides = []  # where each crosses the node's side: on a lane of its own, not along one line
    for end in ("n:first", "n:second"):
        d = re.search(rf'd="([^"]+)"[^>]*data-from="n:two" data-to="{end}"', svg).group(1)
        sides.append({py for px, py in _points(d) if abs(px - x - w) < 1 and y < py < y + h})
    assert sides[0] and sides[1] and not sides[0] & sides[1]
    for end in ("n:both", "n:fn"):  # two layers made what it reads (or may read): the frame
        assert _on_side(_start(svg, "n:two", end), drawn["n:two"])
    assert architecture(g)["two"].read_by == {}  # without an example nothing is seen read
    # an inside that does not say what made its output (one written by hand): the frame too
    said = {k: v for k, v in inside["two"].to_json().items() if k not in ("outputs", "read_by")}
    svg = g.figure(inside={"two": said}).svg()
    assert _on_side(_start(svg, "n:two", "n:first"), boxes(svg)["n:two"])
    # a node fed by two: what it read of each
    p, q = Node.of(TwoHeads()).named("p"), Node.of(TwoHeads()).named("q")
    g = Graph.somatize((p | q) >> Crossed().named("x"))
    inside = architecture(g, torch.randn(2, 4))
    assert inside["p"].read_by == {"x": ["b"]} and inside["q"].read_by == {"x": ["a"]}
    svg = g.figure(inside=inside).svg()
    assert _on_bottom(_start(svg, "n:p", "n:x"), boxes(svg)["l:p:b"])
    assert _on_bottom(_start(svg, "n:q", "n:x"), boxes(svg)["l:q:a"])


class Scaled(nn.Module):
    """A layer of its own (a module holding no module) on part `k` of what it is given."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.k, self.w = k, nn.Parameter(torch.ones(n))

    def forward(self, pair):
        return pair[self.k] * self.w


def test_a_node_that_is_one_layer_is_seen_reading_only_the_part_it_reads():
    """A node after two heads that is one layer of the user's own, reading one head's output
    of the pair it is given: what it read is the one head's, not both, and the edge into it
    leaves from that head."""
    from somatize.torch import architecture

    g = Graph.somatize(
        Node.of(TwoHeads()).named("two")
        >> (Node.of(Scaled(0, 3)).named("first") | Node.of(Scaled(1, 5)).named("second"))
    )
    inside = architecture(g, torch.randn(2, 4))
    assert inside["two"].read_by == {"first": ["a"], "second": ["b"]}
    assert [la.path for la in inside["first"].layers] == [""]  # still one layer
    svg = g.figure(inside=inside).svg()
    assert _on_bottom(_start(svg, "n:two", "n:first"), boxes(svg)["l:two:a"])
    assert _on_bottom(_start(svg, "n:two", "n:second"), boxes(svg)["l:two:b"])


class T5Encoder(Node):
    """T5's encoder: its states, and the decoder's tokens and the mask handed on untouched."""

    def __init__(self, t5: nn.Module) -> None:
        self.encoder = t5.encoder

    def forward(self, x, ctx):
        h = self.encoder(input_ids=x["input_ids"], attention_mask=x["attention_mask"])
        tokens, mask = x["decoder_input_ids"], x["attention_mask"]
        return {"states": h.last_hidden_state, "tokens": tokens, "mask": mask}


class T5Decoder(Node):
    """T5's decoder and head on what the encoder node gave."""

    def __init__(self, t5: nn.Module) -> None:
        self.decoder, self.lm_head = t5.decoder, t5.lm_head

    def forward(self, x, ctx):
        out = self.decoder(
            input_ids=x["tokens"],
            encoder_hidden_states=x["states"],
            encoder_attention_mask=x["mask"],
        )
        return self.lm_head(out.last_hidden_state)


class Embedded(nn.Module):
    """A classifier on what a tokens' embedding of the mask handed on reads (only that)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2, 4)

    def forward(self, out):
        return self.embed(out["mask"])


class Tower(Node):
    """One of CLIP's towers, on its part of the input."""

    def __init__(self, clip: nn.Module, which: str) -> None:
        self.which, self.tower = which, getattr(clip, f"{which}_model")

    def forward(self, x, ctx):
        if self.which == "vision":
            return self.tower(pixel_values=x["pixel_values"])
        return self.tower(input_ids=x["input_ids"], attention_mask=x["attention_mask"])


class Similarity(Node):
    """Each image against each text, from the towers' pooled outputs (CLIP's logits)."""

    def __init__(self, clip: nn.Module) -> None:
        self.text, self.image = clip.text_projection, clip.visual_projection

    def forward(self, x, ctx):
        return self.image(x["vision"].pooler_output) @ self.text(x["text"].pooler_output).T


def test_edges_out_of_real_models_leave_from_what_the_next_node_reads():
    from models import zoo

    from somatize.torch import architecture

    # an encoder node feeding a decoder node its states beside tokens and a mask it hands on
    # (made by none of its layers), and a node reading only the mask
    case = zoo.t5()
    g = Graph.somatize(
        T5Encoder(case.model).named("enc")
        >> (T5Decoder(case.model).named("dec") | Node.of(Embedded()).named("emb"))
    )
    inside = architecture(g, case.example)
    made = inside["enc"].outputs  # (the states' maker: the mask and tokens were passed on)
    assert len(made) == 1 and inside["enc"].read_by == {"dec": made, "emb": []}
    svg = g.figure(inside=inside).svg()
    assert _on_bottom(_start(svg, "n:enc", "n:dec"), boxes(svg)[f"l:enc:{made[0]}"])
    # what no layer made: from the node's frame
    assert _on_side(_start(svg, "n:enc", "n:emb"), boxes(svg)["n:enc"])
    # two towers into one node: each edge from the layer that made the pooled output it read
    case = zoo.clip()
    towers = Tower(case.model, "text").named("text") | Tower(case.model, "vision").named("vision")
    g = Graph.somatize(towers >> Similarity(case.model).named("sim"))
    inside = architecture(g, case.example)
    norms = {"text": "tower.final_layer_norm", "vision": "tower.post_layernorm"}
    for tower, norm in norms.items():
        assert inside[tower].read_by == {"sim": [norm]}
        assert norm in inside[tower].outputs
    assert len(inside["vision"].outputs) == 2  # (its states, made before the pooled ones' norm)
    svg = g.figure(inside=inside).svg()
    for tower, norm in norms.items():
        assert _on_bottom(_start(svg, f"n:{tower}", "n:sim"), boxes(svg)[f"l:{tower}:{norm}"])


class StdConv2d(nn.Conv2d):
    """A weight-standardised convolution (NFNet's, BiT's): a Conv2d by its ancestry."""

    def forward(self, x):
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        w = w / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)


def test_a_closed_block_holding_a_conv_of_its_own_class_gives_an_image():
    """A normaliser-free net (NFNet's way: standardised convolutions, no norm layer) drawn
    with its blocks closed: the stem holds a conv, known by its kind and not by its class's
    name, so what it gives is an image, `ch · h · w`, and so is what the next block gives."""
    from somatize.torch import architecture

    net = nn.Sequential(
        nn.Sequential(StdConv2d(3, 8, 3, padding=1), nn.GELU()),
        nn.Sequential(StdConv2d(8, 16, 3, stride=2, padding=1), nn.GELU()),
    )
    g = Graph.somatize(Node.of(net).named("nf"))
    inside = architecture(g, torch.randn(2, 3, 8, 8), most=2)
    assert [la.path for la in inside["nf"].layers] == ["0", "1"]  # both closed
    svg = g.figure(inside=inside).svg()
    texts = {
        k: re.findall(r"<text[^>]*>([^<]*)</text>", grp)[1]
        for k, grp in re.findall(r'data-id="(l:nf:\d)"(.*?)</g>', svg, re.S)
    }
    assert texts == {
        "l:nf:0": "2 batch · 8 ch · 8 h · 8 w",
        "l:nf:1": "2 batch · 16 ch · 4 h · 4 w",
    }
