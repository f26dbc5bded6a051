"""Each figure's ES module rendered alone in headless Chromium, over http on 127.0.0.1, with
the standalone page's small model (get/set/on/off/send/save_changes) standing in for a kernel.
"""

from __future__ import annotations

import base64
import json
import math
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import figure_data as fd  # noqa: E402

from somatize.figures import CompareTable, LiveAudit, graph_figure  # noqa: E402

# the standalone page delivers messages without buffers; the audit's tests hand the page
# binary buffers as a kernel does: DataViews, one byte off alignment inside a larger buffer
_DELIVER = 'window.smzDeliver = (msg) => fire("msg:custom", msg, []);'
_DELIVER_BINARY = (
    "window.smzDeliver = (msg, b64s) => fire('msg:custom', msg, (b64s || []).map((b) => {"
    " const raw = Uint8Array.from(atob(b), (c) => c.charCodeAt(0));"
    " const whole = new Uint8Array(raw.length + 1); whole.set(raw, 1);"
    " return new DataView(whole.buffer, 1, raw.length); }));"
)


def _open(page, served, name, widget):
    root, base = served
    path = widget.save_html(root / f"{name}.html")
    if isinstance(widget, LiveAudit):
        text = path.read_text(encoding="utf-8")
        assert _DELIVER in text
        path.write_text(text.replace(_DELIVER, _DELIVER_BINARY), encoding="utf-8")
    page.goto(f"{base}/{name}.html")
    page.wait_for_selector("body[data-rendered='yes']", timeout=20_000)
    return page


def _drawn(page, n):
    page.wait_for_function(
        f"() => Number(document.querySelector('.smz-graph')?.dataset.drawn) >= {n}"
    )


def test_graph_boxes_edges_and_a_fold_that_opens(page, served, artifacts):
    plan = fd.plan(enc={"device": "cpu"}, right={"host": "gpu-box"}, head={"cached": True})
    fig = graph_figure(plan, inside=fd.insides())
    _open(page, served, "graph", fig)
    _drawn(page, 1)
    assert page.locator(".smz-node").count() == 5
    assert page.locator(".smz-edge").count() >= 5 + 7  # graph edges and layer edges
    assert page.locator(".smz-group").count() == 1  # left | right grouped
    assert page.locator(".smz-skip").count() == 1  # the residual edge, in the accent colour
    assert page.locator(".smz-pill-device").text_content() == "cpu"
    assert page.locator(".smz-pill-host").text_content() == "@gpu-box"
    assert page.locator(".smz-pill-cached").count() == 1
    convs = page.locator(".smz-kind-conv").count()
    assert convs == 2
    folded = page.locator(".smz-foldable")
    assert "×3" in folded.text_content()
    page.screenshot(path=str(artifacts / "graph-folded.png"), full_page=True)

    folded.click()
    _drawn(page, 2)
    assert page.locator(".smz-kind-conv").count() == 4  # the block three times
    assert page.locator("[data-id='l:enc:blocks.2.conv']").count() == 1
    assert page.evaluate("window.smzModel.get('expanded')") == ["enc:blocks.0"]
    assert page.locator(".smz-skip").count() == 3  # a residual per copy
    page.screenshot(path=str(artifacts / "graph-unfolded.png"), full_page=True)

    page.locator(".smz-foldable").first.click()
    _drawn(page, 3)
    assert page.locator(".smz-kind-conv").count() == 2
    assert page.errors == []


def test_graph_hover_says_kind_shape_parameters(page, served):
    _open(page, served, "hover", graph_figure(fd.plan(), inside=fd.insides()))
    _drawn(page, 1)
    page.locator("[data-id='l:enc:blocks.0.bn']").hover()
    tip = page.locator(".smz-tooltip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "BatchNorm2d 8" in text and "norm" in text
    assert "[4, 8, 8, 8]" in text and "16" in text
    assert "enc.blocks.0.bn" in text


def test_graph_closes_a_node_and_colours_in_place(page, served, artifacts):
    _open(page, served, "colour", graph_figure(fd.plan(), inside=fd.insides()))
    _drawn(page, 1)
    page.locator(".smz-node[data-node='left'] .smz-title").click()
    _drawn(page, 2)
    assert page.evaluate("window.smzModel.get('opened')") == ["enc", "right"]
    assert page.locator("[data-id='l:left:0']").count() == 0
    # colour by node and by node.path, as a probe or an audit would key it
    page.evaluate(
        "window.smzModel.set('colour', {'enc.conv': 0.1, 'enc.blocks.0.bn': 5.0, 'head': 2.0})"
    )
    _drawn(page, 3)
    fill = page.locator("[data-id='l:enc:blocks.0.bn'] path").first.get_attribute("fill")
    assert fill.startswith("rgb(")
    assert page.locator(".smz-scale").count() == 1
    page.screenshot(path=str(artifacts / "graph-coloured.png"), full_page=True)


def test_graph_of_200_nodes_is_drawn_and_readable(page, served, artifacts):
    fig = graph_figure(fd.chain_plan(200))
    _open(page, served, "big", fig)
    _drawn(page, 1)
    assert page.locator(".smz-node").count() == 200
    layout_ms = int(page.evaluate("document.querySelector('.smz-graph').dataset.layoutMs"))
    assert layout_ms < 5000
    # readable: the drawing is not shrunk below 60 % (it wraps into rows and scrolls instead)
    width = float(page.locator("svg.smz-graph-svg").get_attribute("width"))
    view = page.locator("svg.smz-graph-svg").get_attribute("viewBox").split()
    assert width / float(view[2]) >= 0.6
    page.screenshot(path=str(artifacts / "graph-200.png"))


class Relay(LiveAudit):
    """A LiveAudit whose messages are kept to be handed to a page (no kernel here)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outbox = []

    def send(self, content, buffers=None):
        # as a kernel sends it: JSON content, the buffers beside it (here as base64)
        b64 = [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []]
        self.outbox.append([json.loads(json.dumps(content)), b64])


def _facts(step, places=("enc", "enc.blocks.0.conv", "left", "head")):
    out = [{"fact": "loss", "value": 2.0 * math.exp(-step / 15) + 0.05, "step": step}]
    for k, where in enumerate(places):
        grad = 10 ** (-1 - k) * (1 + 0.3 * math.sin(step / 3))
        if where == "left" and step >= 12:
            grad = float("nan")  # this place breaks at step 12
        out.append(
            {
                "fact": "health",
                "where": where,
                "step": step,
                "numbers": {"grad_norm": grad, "update_ratio": 1e-3 * (k + 1), "zero": 0.1 * k},
            }
        )
    return out


def test_audit_cells_appear_as_facts_arrive(page, served, artifacts):
    audit = Relay(interval=0.05)
    _open(page, served, "audit", audit)
    assert page.evaluate("window.smzSent")[0] == {"kind": "hello"}
    page.wait_for_selector(".smz-audit")
    assert page.locator(".smz-cell").count() == 0
    delivered = 0
    began = time.monotonic()
    for step in range(24):
        for fact in _facts(step):
            audit(fact)
        time.sleep(0.01)
        new = audit.outbox[delivered:]  # the sender thread may add more meanwhile
        for msg in new:
            page.evaluate("([m, b]) => window.smzDeliver(m, b)", msg)
        delivered += len(new)
        if step == 5:
            page.wait_for_function("() => document.querySelectorAll('.smz-cell').length > 0")
            early = page.locator(".smz-cell").count()
            assert 0 < early <= 4 * 6
    took = time.monotonic() - began
    audit.sync()
    for msg in audit.outbox[delivered:]:
        page.evaluate("([m, b]) => window.smzDeliver(m, b)", msg)
    # batched: 120 facts, at most one message per interval (and the last one, forced)
    assert len(audit.outbox) <= took / 0.05 + 2
    assert all(b64 for _, b64 in audit.outbox)  # every one carried its values as binary
    page.wait_for_function("() => document.querySelectorAll('.smz-cell').length === 4 * 24")
    assert page.locator(".smz-flagged").count() == 12  # left, NaN from step 12: flagged NAN
    assert page.locator(".smz-loss").count() == 1
    assert page.locator(".smz-metric option").all_inner_texts() == [
        "grad_norm",
        "update_ratio",
        "zero",
    ]
    assert "(log)" in page.locator(".smz-audit-legend").inner_text()
    page.screenshot(path=str(artifacts / "audit.png"), full_page=True)
    page.select_option(".smz-metric", "zero")
    page.wait_for_function(
        "() => document.querySelector('.smz-audit-legend').innerText.startsWith('zero')"
    )
    assert page.evaluate("window.smzModel.get('metric')") == "zero"


def test_audit_page_opened_late_gets_everything(page, served):
    audit = Relay(interval=0.05)
    for step in range(10):
        for fact in _facts(step):
            audit(fact)
    audit.sync()
    _open(page, served, "late", audit)  # the page's hello is answered with the snapshot
    page.wait_for_function("() => document.querySelectorAll('.smz-cell').length === 40")


def test_audit_without_a_kernel_draws_its_picture(page, served, artifacts):
    from somatize.figures._page import page as standalone

    audit = Relay(interval=0.05)
    for step in range(30):
        for fact in _facts(step):
            audit(fact)
    audit.sync()
    # a saved notebook: the traits as they were, and nobody answers the page's hello
    state = {"metric": "grad_norm", "metrics": audit.metrics, "title": "saved"}
    state["picture"] = audit.picture
    root, base = served
    (root / "still.html").write_text(standalone("audit", state, title="saved", replies=[]))
    page.goto(f"{base}/still.html")
    page.wait_for_selector("body[data-rendered='yes']", timeout=20_000)
    page.wait_for_function("() => document.querySelectorAll('.smz-cell').length === 4 * 30")
    assert "waiting" not in page.locator(".smz-audit").inner_text()
    assert page.locator(".smz-flagged").count() == 18  # left, NaN from step 12
    assert page.locator(".smz-loss").count() == 1
    page.screenshot(path=str(artifacts / "audit-picture.png"), full_page=True)


def _table():
    df = pd.DataFrame(
        {
            "params": [1200, 56000, 8000, 300],
            "proxy:synflow": [3.0, 9.5, 7.1, 1.2],
            "proxy:naswot": [10.0, 8.0, 12.0, 4.0],
        },
        index=pd.Index(["tiny", "wide", "deep", "flat"], name="candidate"),
    )
    return CompareTable(df, measured={"tiny": 0.6, "wide": 0.95, "deep": 0.9, "flat": 0.4})


def test_table_sorts_on_header_click_and_shows_rank_correlation(page, served, artifacts):
    table = _table()
    _open(page, served, "table", table)
    rows = lambda: page.locator("tbody tr").evaluate_all(  # noqa: E731
        "rs => rs.map(r => r.dataset.row)"
    )
    assert rows() == ["wide", "deep", "tiny", "flat"]  # by measured, best first
    page.locator("thead th[data-col='params']").click()
    # the same order as by measured, by chance: the sort itself says which column it is
    assert page.evaluate("[window.smzModel.get('sort_by'), window.smzModel.get('ascending')]") == [
        "params",
        False,
    ]
    assert rows() == ["wide", "deep", "tiny", "flat"]
    page.locator("thead th[data-col='params']").click()
    assert rows() == ["flat", "tiny", "deep", "wide"]
    page.locator("thead th[data-col='proxy:naswot']").click()
    assert rows() == ["deep", "tiny", "wide", "flat"]
    corr = page.locator("tfoot td[data-col='proxy:synflow']").inner_text()
    assert corr == "1.00"  # synflow ranks them exactly as measured does
    best = page.locator("tbody tr[data-row='deep'] td[data-col='proxy:naswot']")
    assert "rgba(47,158,68" in best.get_attribute("style")  # best in its column: green
    page.screenshot(path=str(artifacts / "table.png"), full_page=True)


def test_graph_counts_a_tied_weight_once_and_labels_attention_axes(page, served):
    """The node's count is the model's (an embedding and its output layer share one weight),
    and a 4-D tensor inside attention is heads and sequence, not an image's channels."""
    import torch
    from _nodes import Tied

    from somatize import Graph
    from somatize.torch import architecture

    net = Tied()
    inside = architecture(net, torch.tensor([[1, 2, 3]]))
    total = sum(p.numel() for p in net.parameters())
    assert inside["tied"].params == total == 44 + 20
    _open(page, served, "tied", graph_figure(Graph.somatize(net), inside=inside))
    _drawn(page, 1)
    node = page.locator(".smz-node[data-node='tied']").text_content()
    assert f"{total} params" in node  # not 108, the tied weight counted twice
    assert page.errors == []

    plan = {**fd.plan(), "nodes": [n for n in fd.plan()["nodes"] if n["id"] == "enc"]}
    plan["edges"], plan["roots"], plan["leaves"], plan["order"] = [], ["enc"], ["enc"], ["enc"]
    attn = {
        "layers": [
            {
                "path": "attn",
                "kind": "attention",
                "label": "SelfAttention",
                "shape": [2, 8, 16],
                "params": 0,
                "block": None,
                "times": 1,
                "repeats": [],
            },
            {
                "path": "attn.sdpa",
                "kind": "attention",
                "label": "sdpa",
                "shape": [2, 2, 8, 8],
                "params": 0,
                "block": "attn",
                "times": 1,
                "repeats": [],
            },
            {
                "path": "conv",
                "kind": "conv",
                "label": "Conv2d",
                "shape": [2, 3, 8, 8],
                "params": 0,
                "block": None,
                "times": 1,
                "repeats": [],
            },
        ],
        "edges": [["attn.sdpa", "conv"]],
        "how": "traced",
        "why": None,
    }
    attn["layers"].append(
        {"path": "c_attn", "kind": "learned", "label": "Conv1D", "shape": [2, 8, 48],
         "params": 0, "block": None, "times": 1, "repeats": []}
    )  # fmt: skip
    _open(page, served, "axes", graph_figure(plan, inside={"enc": attn}))
    _drawn(page, 1)
    # drawn by its kind (a linear layer), not by the word in its name
    assert "smz-kind-linear" in page.locator("[data-id='l:enc:c_attn']").get_attribute("class")
    assert "2 heads · 8 seq" in page.locator("[data-id='l:enc:attn.sdpa']").text_content()
    assert "3 ch · 8 h · 8 w" in page.locator("[data-id='l:enc:conv']").text_content()
