"""Each figure's browser half in headless Chromium, alone: a saved page (`save_html`) over
http on 127.0.0.1, with the page's small model (get/set/on/off/send/save_changes) standing in
for a kernel; messages a kernel would send are handed to it as a kernel sends them."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import figure_data as fd  # noqa: E402

from somatize.figures import CompareTable, LiveAudit, graph_figure  # noqa: E402

WIDGETS = Path(__file__).resolve().parents[2] / "widgets"


def _open(page, served, name, widget):
    root, base = served
    widget.save_html(root / f"{name}.html")
    page.goto(f"{base}/{name}.html")
    page.wait_for_selector("body[data-rendered='yes']", timeout=20_000)
    return page


def _view(page):
    """The graph's visible region, in the drawing's units, and the drawing's size."""
    return page.evaluate(
        """() => { const s = document.querySelector('.smz-graph svg.smz-graph-svg');
        const v = s.getAttribute('viewBox').split(' ').map(Number);
        return {x: v[0], y: v[1], w: v[2], h: v[3],
                scale: Number(document.querySelector('.smz-graph').dataset.scale)}; }"""
    )


def test_200_nodes_fit_the_width_pan_zoom_and_show_a_minimap(page, served, artifacts):
    fig = graph_figure(fd.chain_plan(200), width=1240)
    _open(page, served, "big", fig)
    width = float(fig.svg().split('width="')[1].split('"')[0])
    viewport = page.locator(".smz-viewport").bounding_box()
    view = _view(page)
    # the width fitted: every row is in view across, at a scale one reads at
    assert view["w"] >= width - 1 and view["scale"] >= 0.9
    assert viewport["width"] <= 1280 and viewport["height"] <= 642
    assert page.locator(".smz-minimap").is_visible()  # 26 rows: past a screenful
    page.screenshot(path=str(artifacts / "graph-200.png"))
    page.locator(".smz-fit").click()  # all of it, however small
    fitted = _view(page)
    height = float(fig.svg().split('height="')[1].split('"')[0])
    assert fitted["w"] >= width - 1 and fitted["h"] >= height - 1 and fitted["scale"] < 0.3
    page.locator(".smz-width").click()
    page.wait_for_function(
        "() => Number(document.querySelector('.smz-graph').dataset.scale) >= 0.9"
    )
    viewport = page.locator(".smz-viewport").bounding_box()  # where it is now, after the fit
    # a drag pans, Ctrl with the wheel zooms where the pointer is
    page.mouse.move(viewport["x"] + 600, viewport["y"] + 300)
    page.mouse.down()
    page.mouse.move(viewport["x"] + 600, viewport["y"] + 100, steps=5)
    page.mouse.up()
    assert _view(page)["y"] > view["y"] + 150
    page.keyboard.down("Control")
    page.mouse.wheel(0, -300)
    page.keyboard.up("Control")
    assert _view(page)["scale"] > view["scale"] * 1.5
    lens = page.locator(".smz-lens").bounding_box()
    assert lens["y"] > page.locator(".smz-minimap").bounding_box()["y"] + 2  # it follows
    assert page.errors == []


def test_the_live_graph_is_the_drawing_the_kernel_made_and_clicks_change_its_traits(
    page, served, artifacts
):
    plan = fd.plan(enc={"device": "cpu"}, right={"host": "gpu-box"}, head={"cached": True})
    fig = graph_figure(plan, inside=fd.insides())
    _open(page, served, "graph", fig)
    assert page.locator(".smz-node").count() == 5
    assert page.locator(".smz-skip").count() == 1
    assert page.locator(".smz-pill-host").text_content() == "@gpu-box"
    shown = page.evaluate("document.querySelector('.smz-drawing').innerHTML")
    assert shown.count('data-id="l:') == fig.svg().count('data-id="l:')  # the same drawing
    page.screenshot(path=str(artifacts / "graph.png"), full_page=True)
    page.locator("[data-id='l:enc:blocks.0.bn']").hover()
    tip = page.locator(".smz-tooltip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "BatchNorm2d 8" in text and "norm" in text and "[4, 8, 8, 8]" in text
    assert page.locator(".smz-graph title").count() == 0  # no native tooltip beside ours
    page.locator(".smz-foldable").click()
    assert page.evaluate("window.smzModel.get('expanded')") == ["enc:blocks.0"]
    page.locator(".smz-fit").click()  # all of it in view, the branches below enc included
    page.locator(".smz-node[data-id='n:left'] .smz-title").click()
    assert page.evaluate("window.smzModel.get('opened')") == ["enc", "right"]
    assert page.errors == []


class Relay(LiveAudit):
    """A LiveAudit whose messages are kept to be handed to a page as a kernel sends them:
    JSON content, the buffers beside it (here base64)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outbox = []

    def send(self, content, buffers=None):
        b64 = [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []]
        self.outbox.append([json.loads(json.dumps(content)), b64])


_DELIVER = """([m, b64s]) => window.smzModel.deliver(m, b64s.map((b) => {
  const raw = Uint8Array.from(atob(b), (c) => c.charCodeAt(0));
  const whole = new Uint8Array(raw.length + 1); whole.set(raw, 1);
  return new DataView(whole.buffer, 1, raw.length); }))"""  # a view one byte off, as kernels hand them


def _facts(step):
    out = [{"fact": "loss", "value": 2.0 * math.exp(-step / 15) + 0.05, "step": step}]
    for k, node in enumerate(("enc", "left", "head")):
        grad = 10 ** (-1 - k) * (1 + 0.3 * math.sin(step / 3))
        nan = node == "left" and step >= 12  # this place breaks at step 12
        out.append(
            {
                "fact": "health",
                "node": node,
                "inside": None,
                "step": step,
                "grad_norm": math.nan if nan else grad,
                "update_ratio": 1e-3 * (k + 1),
                "zero_frac_max": 0.1 * k,
                "nan": nan,
            }
        )
    return out


def test_the_audit_fills_from_messages_and_a_metric_switch_redraws_from_what_it_has(
    page, served, artifacts
):
    audit = Relay(interval=0.05)
    _open(page, served, "audit", audit)
    assert page.evaluate("window.smzSent") == [{"kind": "hello"}]
    for step in range(30):
        for fact in _facts(step):
            audit(fact)
    audit.sync()
    for msg in audit.outbox:
        page.evaluate(_DELIVER, msg)
    page.wait_for_function("() => document.querySelector('.smz-audit').dataset.cells === '90'")
    assert page.locator(".smz-metric option").all_inner_texts() == [
        "grad_norm",
        "update_ratio",
        "zero_frac_max",
        "nan",
    ]
    assert page.evaluate("document.querySelector('.smz-audit').dataset.metric") == "update_ratio"
    legend = page.locator(".smz-audit-legend").inner_text()
    assert "not measured" in legend and "flag: numeric" in legend
    page.screenshot(path=str(artifacts / "audit.png"), full_page=True)
    sent = len(audit.outbox)
    page.select_option(".smz-metric", "grad_norm")
    # drawn at once from what the page holds: the kernel is asked for nothing
    assert page.evaluate("document.querySelector('.smz-audit').dataset.metric") == "grad_norm"
    assert int(page.evaluate("document.querySelector('.smz-audit').dataset.coloured")) == 90 - 18
    assert page.evaluate("window.smzSent") == [{"kind": "hello"}] and len(audit.outbox) == sent
    assert "(log)" in page.locator(".smz-audit-legend").inner_text()  # grad norms span decades
    # the tooltip explains the metric, and stays in the window at its bottom-right corner
    page.set_viewport_size({"width": 1000, "height": 430})
    page.locator("canvas.smz-heat").scroll_into_view_if_needed()
    page.wait_for_timeout(100)
    x0, top, cw, row, nb = map(
        float, page.evaluate("document.querySelector('.smz-audit').dataset.grid").split()
    )
    canvas = page.locator("canvas.smz-heat").bounding_box()
    page.mouse.move(
        canvas["x"] + x0 + (nb - 0.5) * cw, canvas["y"] + top + row + 5
    )  # left, last step
    tip = page.locator(".smz-audit-tip")
    tip.wait_for(state="visible")
    assert "the size of the gradient" in tip.inner_text() and "NAN" in tip.inner_text()
    box = tip.bounding_box()
    assert (
        box["x"] >= 0
        and box["y"] >= 0
        and box["x"] + box["width"] <= 1000
        and box["y"] + box["height"] <= 430
    )
    page.locator(".smz-log").check()
    assert "(log)" in page.locator(".smz-loss-svg").inner_html()
    assert page.errors == []


def test_an_audit_saved_with_no_kernel_draws_its_record(page, served, artifacts):
    audit = LiveAudit(interval=0.05, title="saved")
    for step in range(40):
        for fact in _facts(step):
            audit(fact)
    _open(page, served, "saved", audit)
    page.wait_for_function("() => document.querySelector('.smz-audit').dataset.cells === '120'")
    assert (
        page.locator(".smz-loss").count() == 1
        and "waiting" not in page.locator(".smz-audit").inner_text()
    )
    page.screenshot(path=str(artifacts / "audit-saved.png"), full_page=True)


def test_one_place_at_one_step_is_said_in_the_singular_live_and_in_the_static_face(
    page, served
):
    audit = LiveAudit(interval=0.05, title="one")
    audit({"fact": "health", "node": "enc", "inside": None, "step": 0, "grad_norm": 0.5})
    assert "one: 1 place, 1 step" in audit.face()
    _open(page, served, "one", audit)
    status = page.locator(".smz-audit-status")
    page.wait_for_function("() => document.querySelector('.smz-audit-status').textContent")
    assert status.inner_text() == "1 place · 1 step"
    two = LiveAudit(interval=0.05, title="two")
    for step in range(2):
        for fact in _facts(step):
            two(fact)
    assert "two: 3 places, 2 steps" in two.face()
    _open(page, served, "two", two)
    page.wait_for_function("() => document.querySelector('.smz-audit-status').textContent")
    assert status.inner_text() == "3 places · 2 steps"


def test_an_audit_of_losses_only_draws_the_loss_plot_alone_each_curve_named(
    page, served, artifacts
):
    audit = LiveAudit(interval=0.05, title="losses", flags=False)
    for way, end in {"backprop": 0.0068, "Split": 0.0068, "ForwardForward": 0.175}.items():
        watcher = audit.run(way)
        for step in range(1, 21):
            watcher({"fact": "loss", "value": 2.0 * (end / 2.0) ** (step / 20), "step": step})
    _open(page, served, "losses", audit)
    page.wait_for_function("() => document.querySelectorAll('.smz-loss').length === 3")
    shown = page.locator(".smz-audit").inner_text()
    assert "waiting" not in shown and "not measured" not in shown and "places" not in shown
    assert not page.locator(".smz-metric").is_visible()  # no metric: there is no heatmap
    labels = page.locator(".smz-loss-svg text:has(title)")
    tips = labels.evaluate_all("ts => ts.map(t => t.querySelector('title').textContent)")
    assert sorted(t.split(": step")[0] for t in tips) == ["ForwardForward", "Split", "backprop"]
    ys = sorted(labels.evaluate_all("ts => ts.map(t => Number(t.getAttribute('y')))"))
    assert min(b - a for a, b in zip(ys[:-1], ys[1:], strict=True)) >= 11  # equal losses, apart
    assert "backprop 0.0068" in labels.evaluate_all("ts => ts.map(t => t.firstChild.textContent)")
    page.screenshot(path=str(artifacts / "audit-losses.png"), full_page=True)
    assert page.errors == []


def _wide_table():
    names = ["tiny", "wide", "deep", "flat", "resnet-ish", "transformer-small", "mlp-128"]
    cols = {"params": [1200, 56000, 8000, 300, 11e6, 2.3e6, 17000]}
    for k, p in enumerate(
        ["synflow", "zen", "naswot", "jacob_cov", "snip", "grasp", "grad_norm", "fisher"]
    ):
        cols["proxy:" + p] = [math.sin(k + i) * 10 for i in range(7)]
    for k in range(16):
        cols[f"probe:metric_{k:02d}"] = [0.1 * i for i in range(7)]
    df = pd.DataFrame(cols, index=pd.Index(names, name="candidate"))
    return CompareTable(
        df, measured=dict(zip(names, [0.6, 0.95, 0.9, 0.4, 0.97, 0.93, 0.8], strict=True))
    )


def test_the_table_fits_1400_px_keeps_its_names_in_view_and_sorts(chromium, served, artifacts):
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        _open(page, served, "table", _wide_table())
        heads = page.locator("thead th[data-col]").evaluate_all(
            "hs => hs.filter(h => h.offsetParent).map(h => h.dataset.col)"
        )
        assert heads[:3] == ["candidate", "measured", "params"]  # measured next to the names
        assert page.locator(".smz-scroll").bounding_box()["width"] <= 1400
        table = page.locator(".smz-table table").bounding_box()
        assert table["x"] + table["width"] <= 1400
        rows = lambda: page.locator("tbody tr").evaluate_all("rs => rs.map(r => r.dataset.row)")  # noqa: E731
        assert rows()[:2] == ["resnet-ish", "wide"]
        page.screenshot(path=str(artifacts / "table-1400.png"), full_page=True)
        page.locator("thead th[data-col='params']").click()
        assert rows() == [
            "resnet-ish",
            "transformer-small",
            "wide",
            "mlp-128",
            "deep",
            "tiny",
            "flat",
        ]
        page.locator("thead th[data-col='params']").click()
        assert rows()[0] == "flat"
        assert page.evaluate(
            "[window.smzModel.get('sort_by'), window.smzModel.get('ascending')]"
        ) == ["params", True]
        # the probe's columns behind a toggle; opened, the table scrolls and the names stay
        page.locator(".smz-toggle").click()
        assert page.locator("td[data-col='probe:metric_15']").first.is_visible()
        page.locator(".smz-scroll").evaluate("s => { s.scrollLeft = s.scrollWidth; }")
        name = page.locator("tbody th.smz-index").first.bounding_box()
        assert name["x"] <= 30 and page.locator("tbody th.smz-index").first.is_visible()
        page.screenshot(path=str(artifacts / "table-scrolled.png"))
        page.select_option(".smz-scatter-pick", "proxy:zen")
        assert page.locator(".smz-scatter[data-col='proxy:zen']").is_visible()
        assert not page.locator(".smz-scatter[data-col='proxy:synflow']").is_visible()
        assert page.evaluate("window.smzModel.get('scatter')") == "proxy:zen"
        assert errors == []
    finally:
        context.close()


def test_the_browser_writes_numbers_as_the_kernel_does(page, served):
    root, base = served
    shutil.copy(WIDGETS / "common.js", root / "common.js")
    (root / "numbers.html").write_text("<!doctype html><body>numbers</body>")
    page.goto(f"{base}/numbers.html")
    values = [
        1,
        -1,
        0.125,
        2.5e-5,
        9.996e-5,
        0.7062,
        -6.5e6,
        999.96,
        1234,
        0.001,
        12.345,
        3e14,
        1.234e15,
        -2e16,
        999.6e12,
        1e45,
        9.9996e299,
        1e-300,
        0.0015,
        2.675,
        -0.5,
    ]
    # the kernel's way: what a comparison table writes in its cells
    table = CompareTable(
        pd.DataFrame({"proxy:v": values}, index=[f"r{k}" for k in range(len(values))])
    )
    body = table.face().split("<tbody>")[1]
    kernel = dict(
        re.findall(r'<tr data-row="(r\d+)">.*?<td data-col="proxy:v"[^>]*>([^<]*)</td>', body)
    )
    got = page.evaluate(
        "async (vs) => { const m = await import('/common.js'); return vs.map((v) => m.number(v)); }",
        values,
    )
    assert got == [kernel[f"r{k}"] for k in range(len(values))]


def _text_models():
    """The columns compare() gave a tester's text models (naswot left out of the LSTM), and a
    candidate with a longer name."""
    nan = math.nan
    cols = {
        "params": [11714, 36866, 30786, 5510],
        "proxy:synflow": [4.64, 5.71, 5.85, 13.6],
        "proxy:naswot": [nan, 100.2, 113.2, 164.0],
        "proxy:snip": [0.244, 0.931, 1.53, 0.515],
        "proxy:grasp": [-0.0983, -10.8, -52.3, -0.77],
        "proxy:grad_norm": [-1.36, 1.18, 1.63, -0.264],
        "proxy:fisher": [-10.5, -7.69, -7.06, 1.04],
        "probe:jacobian_gain": [0.375, 1.0, 0.554, 0.31],
        "probe:jacobian_spread": [0.11, 0.0246, 0.0632, 0.2],
        "probe:sat_frac_max": [0.0, 0.0, 0.0, 0.0],
        "probe:signal_gain": [0.462, 0.289, 0.513, 0.35],
        "probe:zero_frac_max": [0.0, 0.0, 0.0, 0.02],
        "probe:flags": ["", "", "", ""],
    }
    names = ["lstm", "bert", "gpt2", "dead relu cnn"]
    df = pd.DataFrame(cols, index=pd.Index(names, name="candidate"))
    df.attrs["left_out"] = {"lstm": {"proxy:naswot": NO_RELU}}  # as compare() says why
    return CompareTable(df)


NO_RELU = "naswot reads activation layers, and this graph has none"


_FIT = """() => { const s = document.querySelector('.smz-scroll');
  return {over: s.scrollWidth - s.clientWidth,
          right: s.querySelector('table').getBoundingClientRect().right,
          cut: [...document.querySelectorAll('tbody th.smz-index')]
                 .filter((h) => h.scrollWidth > h.clientWidth).map((h) => h.textContent)}; }"""


def test_the_table_fits_1400_px_names_whole_and_says_why_live_and_in_its_static_face(
    chromium, served
):
    root, base = served
    table = _text_models()
    # the static face as a viewer without a doctype shows it (tables there drop the font
    # they sit in) and as JupyterLab's rendered HTML does (its own table font and padding)
    (root / "face-quirks.html").write_text(table.face())
    lab = (
        "<style>table{font-size:13px;table-layout:fixed;line-height:normal}"
        "td,th{padding:.5em;white-space:normal;line-height:normal;max-width:none}</style>"
    )
    (root / "face-lab.html").write_text(f"<!doctype html>{lab}<div>{table.face()}</div>")
    table.save_html(root / "live-text.html")
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    try:
        for name in ("face-quirks", "face-lab", "live-text"):
            page.goto(f"{base}/{name}.html")
            page.wait_for_selector("tbody th.smz-index")
            fit = page.evaluate(_FIT)
            assert fit["over"] <= 0 and fit["right"] <= 1400, (name, fit)
            assert fit["cut"] == [], (name, fit)
            # why naswot is not there: on its cell, and under the table in view
            cell = page.locator("tr[data-row='lstm'] td[data-col='proxy:naswot']")
            assert NO_RELU in cell.get_attribute("title")
            note = page.locator(".smz-left-out")
            assert (
                note.is_visible() and NO_RELU in note.inner_text() and "lstm" in note.inner_text()
            )
    finally:
        context.close()
