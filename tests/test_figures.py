"""The Python halves of the figures: what they hold, what they refuse, what they save.

The browser halves are tested in a real Chromium under tests/browser/."""

from __future__ import annotations

import base64
import math
import re
import time
import xml.etree.ElementTree as ET

import figure_data as fd
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from somatize import Graph, Node
from somatize.figures import CompareTable, GraphFigure, LiveAudit, compare, graph_figure
from somatize.figures._page import STATIC


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


# -- graph figure -------------------------------------------------------------------------
def test_a_graph_draws_from_its_plan():
    g = small_graph()
    fig = g.figure()
    assert isinstance(fig, GraphFigure)
    assert [n["id"] for n in fig.plan["nodes"]] == ["enc", "left", "right", "join"]
    assert fig.plan["edges"] == [list(e) for e in g.edges()]
    assert fig.inside == {} and fig.opened == []
    data, _ = g._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == repr(g)


def test_insides_open_by_default_and_are_taken_as_objects_or_dicts():
    g = small_graph()
    fig = g.figure(inside={"enc": FakeInside(fd.inside_linear(True)), "left": fd.inside_linear(0)})
    assert fig.opened == ["enc", "left"]
    assert [layer["path"] for layer in fig.inside["enc"]["layers"]] == ["0", "1"]
    only = graph_figure(g, inside={"enc": fd.inside_linear(True)}, opened=[])
    assert only.opened == []


def test_the_real_architecture_is_drawn():
    g = small_graph()
    from somatize.torch import architecture

    fig = g.figure(inside=architecture(g, torch.randn(2, 4)))
    assert set(fig.inside) >= {"enc", "left", "right"}
    layer = fig.inside["enc"]["layers"][0]
    assert layer["kind"] == "learned" and layer["shape"] == [2, 4] and layer["params"] == 20


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


def test_colours_keyed_by_node_or_path_and_a_refused_recolour_changes_nothing():
    g = small_graph()
    fig = g.figure(colour={"enc": 1, "left.fc": torch.tensor(2.5), "right": float("nan")})
    assert fig.colour == {"enc": 1.0, "left.fc": 2.5, "right": "nan"}
    with pytest.raises(ValueError):
        fig.recolour({"enc": 3.0, "ghost": 1.0})
    assert fig.colour == {"enc": 1.0, "left.fc": 2.5, "right": "nan"}
    fig.recolour({"join": 7.0}, label="grad norm")
    assert fig.colour == {"join": 7.0} and fig.colour_label == "grad norm"


def test_saved_html_is_standalone_and_offline(tmp_path):
    fig = graph_figure(fd.plan(), inside=fd.insides(), colour={"enc.conv": 1.0})
    text = fig.save_html(tmp_path / "g.html").read_text()
    assert '"blocks.0.conv"' in text and '"enc.conv": 1.0' in text
    # nothing loaded from anywhere: no src= or href= to a URL, the bundle inlined
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)
    assert len(text) > (STATIC / "graph.js").stat().st_size


def test_svg_without_a_browser_is_a_real_drawing(tmp_path):
    fig = graph_figure(fd.plan(), inside=fd.insides(), colour={"head": 1.0, "join": 2.0})
    path = fig.save_svg(tmp_path / "g.svg")
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    texts = [t.text for t in root.iter() if t.tag.endswith("text")]
    for n in ("enc", "left", "right", "join", "head"):
        assert n in texts
    assert any(t and t.startswith("Res  ×3") for t in texts)
    assert len([p for p in root.iter() if p.tag.endswith("path")]) >= 5  # the edges
    # what the browser hands back wins
    fig._svg = '<svg xmlns="http://www.w3.org/2000/svg"><text>drawn by ELK</text></svg>'
    assert "drawn by ELK" in fig.save_svg(tmp_path / "b.svg").read_text()


# -- live audit ---------------------------------------------------------------------------
class Relay(LiveAudit):
    """A LiveAudit whose messages are kept (no kernel in these tests), read as the page reads
    them (binary columns and runs of steps made plain); `raw` keeps them as sent."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outbox = []
        self.raw = []

    def send(self, content, buffers=None):
        self.raw.append((content, [bytes(b) for b in buffers or []]))
        self.outbox.append(plain(content, buffers or []))


HOLE = 0x7FF8_534D_5A00_0001


def column(c, buffers):
    """A column as sent, as plain values: a hole None, a measured NaN a float NaN."""
    if isinstance(c, list):
        return c
    raw = base64.b64decode(c["b64"]) if "b64" in c else bytes(buffers[c["buffer"]])
    values = np.frombuffer(raw, dtype="<f8")
    bits = np.frombuffer(raw, dtype="<u8")
    out = [None if b == HOLE else float(v) for v, b in zip(values, bits, strict=True)]
    for i, v in c.get("odd", []):
        out[i] = v
    return out


def steps_of(steps):
    if isinstance(steps, list):
        return steps
    if "b64" in steps:
        return [int(v) for v in np.frombuffer(base64.b64decode(steps["b64"]), dtype="<f8")]
    first, count = steps["run"]
    return list(range(first, first + count))


def plain(message, buffers):
    out = dict(message)
    out["loss"] = [steps_of(message["loss"][0]), column(message["loss"][1], buffers)]
    out["places"] = [
        [where, steps_of(steps), {k: column(c, buffers) for k, c in columns.items()}, flags]
        for where, steps, columns, flags in message["places"]
    ]
    return out


def health(where, step, **numbers):
    return {"fact": "health", "where": where, "step": step, "numbers": numbers}


def cells_of(messages):
    """(where, step, numbers, flags) per cell from columnar messages, as the page reads them."""
    out = []
    for m in messages:
        for where, steps, columns, flagged in m["places"]:
            flags = dict((i, f) for i, f in flagged)
            for i, step in enumerate(steps):
                numbers = {k: v[i] for k, v in columns.items() if v[i] is not None}
                out.append((where, step, numbers, flags.get(i, [])))
    return out


def losses_of(messages):
    return [(s, v) for m in messages for s, v in zip(*m["loss"], strict=True)]


def test_audit_batches_what_it_sends_and_sends_the_rest_later():
    audit = Relay(interval=0.2)
    began = time.monotonic()
    for step in range(500):
        audit({"fact": "loss", "value": 1.0 / (step + 1), "step": step})
        audit(health("enc", step, grad_norm=0.1))
        audit({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 1.0})
    took = time.monotonic() - began
    # what it has seen is there at once, before anything was sent
    assert audit.metrics == ["grad_norm"] and audit.metric == "grad_norm"
    assert len(audit.frame()) == 500 and len(audit.loss) == 500
    time.sleep(0.6)  # the rest goes out once the interval has passed, without another fact
    assert 1 <= len(audit.outbox) <= 3 + took / 0.2  # one message per interval at most
    assert len(cells_of(audit.outbox)) == 500 and len(losses_of(audit.outbox)) == 500
    assert [m["seq"] for m in audit.outbox] == list(range(1, len(audit.outbox) + 1))
    assert audit._thread is None  # the sender stops when the facts do
    # and the picture a page without a kernel draws has caught up
    picture = plain(audit.picture, [])
    assert picture["kind"] == "reset" and len(picture["places"][0][1]) <= 240
    assert picture["places"][0][1][-1] == 499 and picture["loss"][0][-1] == 499
    audit(health("enc", 500, grad_norm=0.2))  # a new fact wakes the sender again
    time.sleep(0.5)
    assert cells_of(audit.outbox[-1:]) == [("enc", 500, {"grad_norm": 0.2}, [])]


def test_audit_flags_with_the_health_verdict_and_keeps_nan_apart_from_holes():
    audit = Relay(interval=0.01)
    audit(health("enc", 0, grad_norm=float("nan"), zero=0.1))
    audit(health("head", 0, grad_norm=1e-9))
    audit(health("left", 0, grad_norm=0.1))
    audit(health("left", 1, zero=0.99))  # another metric set: a hole in grad_norm
    audit.sync()
    cells = {(c[0], c[1]): c for c in cells_of(audit.outbox)}
    assert math.isnan(cells["enc", 0][2]["grad_norm"]) and cells["enc", 0][3] == ["NAN"]
    assert cells["head", 0][3] == ["VANISHING"]
    assert cells["left", 0][3] == [] and cells["left", 0][2] == {"grad_norm": 0.1}
    assert cells["left", 1][2] == {} and cells["left", 1][3] == ["DEAD"]  # a hole, flagged
    assert all(set(c[2]) <= {"grad_norm"} for c in cells.values())  # the chosen metric's only
    # choosing another metric sends its values (everything seen, as a reset) and repaints
    before = len(audit.outbox)
    audit.metric = "zero"
    assert [m["kind"] for m in audit.outbox[before:]] == ["reset"]
    cells = {(c[0], c[1]): c for c in cells_of(audit.outbox[before:])}
    assert cells["left", 1][2] == {"zero": 0.99} and cells["enc", 0][2] == {"zero": 0.1}
    assert cells["head", 0][2] == {} and cells["head", 0][3] == ["VANISHING"]
    assert set(audit.picture["places"][0][2]) == {"zero"}
    frame = audit.frame()
    assert list(frame["where"]) == ["enc", "head", "left", "left"]
    assert math.isnan(frame.loc[0, "grad_norm"]) and frame.loc[0, "flags"] == ["NAN"]
    assert math.isnan(frame.loc[3, "grad_norm"]) and frame.loc[3, "zero"] == 0.99
    assert audit.metrics == ["grad_norm", "zero"]
    # the picture carries the flags too
    picture = {p[0]: p for p in plain(audit.picture, [])["places"]}
    assert picture["head"][3] == [[0, ["VANISHING"]]]


def test_audit_merges_two_facts_of_one_place_and_step():
    audit = Relay(interval=0.01, verdict=None)
    audit(health("enc", 3, grad_norm=0.5))
    audit(health("enc", 3, zero=0.2))
    frame = audit.frame()
    assert len(frame) == 1 and frame.loc[0, "grad_norm"] == 0.5 and frame.loc[0, "zero"] == 0.2


def test_audit_refuses_a_malformed_fact_and_keeps_nothing_of_it():
    audit = Relay(interval=0.01)
    with pytest.raises(ValueError, match="step"):
        audit(health("enc", 1.5, grad_norm=0.1))
    with pytest.raises(ValueError, match="where"):
        audit({"fact": "health", "step": 1, "numbers": {"grad_norm": 0.1}})
    assert audit.frame().empty and audit.metrics == []
    audit(health("enc", 2, grad_norm=1))  # an int is a number; numpy and torch scalars too
    audit(health("enc", 3, grad_norm=torch.tensor(0.5)))
    assert audit.frame()["grad_norm"].tolist() == [1.0, 0.5]
    audit(health("enc", 4, grad_norm=True))  # no number: kept as it is, drawn as a hole
    assert audit.frame()["grad_norm"].tolist() == [1.0, 0.5, True]


def test_audit_sends_values_as_binary_and_steps_as_runs():
    audit = Relay(interval=0.01, verdict=None)
    for step in range(4):
        audit({"fact": "loss", "value": 1.5, "step": step})
        audit(health("enc", step, grad_norm=[0.5, float("nan"), float("inf"), 2.0][step]))
    audit(health("enc", 9, zero=0.3))  # a gap in the steps; a hole in grad_norm
    audit(health("enc", 10, grad_norm="big"))  # no number: kept aside, sent as it is
    audit.sync()
    (content, buffers), *_ = audit.raw
    assert content["loss"][0] == {"run": [0, 4]} and content["loss"][1] == {"buffer": 0}
    where, steps, columns, _ = content["places"][0]
    assert where == "enc" and steps == [0, 1, 2, 3, 9, 10]  # not a run: a list
    assert columns["grad_norm"] == {"buffer": 1, "odd": [[5, "big"]]}
    bits = np.frombuffer(buffers[1], dtype="<u8")
    assert bits[4] == HOLE and bits[1] != HOLE  # a hole is not a measured NaN
    values = plain(content, buffers)["places"][0][2]["grad_norm"]
    assert values[0] == 0.5 and math.isnan(values[1]) and values[2] == math.inf
    assert values[3:] == [2.0, None, "big"]


def test_a_saved_page_gets_json_with_nan_as_text_and_holes_as_null():
    audit = Relay(interval=0.01, verdict=None)
    audit(health("enc", 0, grad_norm=float("nan")))
    audit(health("enc", 1, zero=0.5))
    snap = audit.snapshot()
    assert snap["kind"] == "reset"
    assert snap["places"][0][1] == [0, 1]
    assert snap["places"][0][2] == {"grad_norm": ["nan", None], "zero": [None, 0.5]}


def test_audit_keeps_a_fact_as_it_was_when_handed():
    audit = Relay(interval=0.01, verdict=None)
    numbers = {"grad_norm": 0.5}
    audit({"fact": "health", "where": "enc", "step": 0, "numbers": numbers})
    numbers["grad_norm"] = 9.0  # the caller reuses its dict: what was handed is kept
    audit({"fact": "health", "where": "enc", "step": 1, "numbers": numbers})
    assert audit.frame()["grad_norm"].tolist() == [0.5, 9.0]


def test_audit_columns_are_what_the_facts_said_whatever_the_batching():
    import random

    rnd = random.Random(0)
    facts, expected = [], {}
    for step in range(300):
        for where in ("a", "b", "c"):
            if rnd.random() < 0.2:
                continue
            names = ["m1", "m2", "m3"] if rnd.random() < 0.8 else rnd.sample(["m1", "m3", "m4"], 2)
            numbers = {
                n: rnd.choice([rnd.random(), 1, np.float32(0.25), float("inf")]) for n in names
            }
            facts.append(health(where, step, **numbers))
            expected[(where, step)] = {n: float(v) for n, v in numbers.items()}
    for interval in (0.001, 10.0):  # batches of one or two facts, and one batch of all
        audit = Relay(interval=interval, verdict=None)
        for k, fact in enumerate(facts):
            audit(fact)
            if interval > 1 and k == len(facts) // 2:
                audit.sync()  # half by the reader's own hand
            elif interval < 1 and k % 97 == 0:
                time.sleep(0.005)
        frame = audit.frame()
        assert len(frame) == len(expected)
        for row in frame.to_dict("records"):
            want = expected[(row["where"], row["step"])]
            for name in ("m1", "m2", "m3", "m4"):
                got = row.get(name, float("nan"))
                assert (got == want[name]) if name in want else math.isnan(got)


def test_audit_keeps_bools_aside_and_judges_them_as_an_audit_sends_them():
    # what somatize.torch.Audit sends: NaN and infinity as bools, channel counts as ints
    audit = Relay(interval=10.0)
    for step in range(300):
        numbers = {"grad_norm": 0.1, "nan": step == 123, "inf": False, "dead_channels": 0}
        audit(health("enc", step, **numbers))
    audit(health("enc", 300, grad_norm=0.1, nan=False, inf=True, dead_channels=2))
    audit.sync()  # one batch: the sender thread has not run
    frame = audit.frame()
    flagged = {s: f for s, f in zip(frame["step"], frame["flags"], strict=True) if f}
    assert flagged == {123: ["NAN"], 300: ["INF"]}  # an inf makes the other numbers moot
    assert frame["nan"].tolist()[122:124] == [False, True]  # kept as they were
    assert frame["dead_channels"].tolist()[-2:] == [0.0, 2.0]  # an int is a number
    cells = {c[1]: c for c in cells_of(audit.outbox)}
    assert cells[123][3] == ["NAN"] and cells[5][3] == []
    audit.metric = "nan"  # a metric of bools: sent as they are, beside the holes
    (content, buffers) = audit.raw[-1]
    assert content["places"][0][2]["nan"]["odd"][123] == [123, True]
    assert cells_of(audit.outbox[-1:])[123][2] == {"nan": True}
    # a bool costs its column's 8 bytes, not an entry kept aside: a long run stays small
    assert audit._places["enc"].odd == {}
    assert audit.snapshot()["places"][0][2]["nan"][122:124] == [False, True]


def test_the_screen_reads_a_bool_in_a_column_as_no_number():
    from somatize.figures._screen import FALSE_BITS, MISSING_BITS, TRUE_BITS, screen_of
    from somatize.health import verdict

    words = np.array([FALSE_BITS, TRUE_BITS, MISSING_BITS, FALSE_BITS], dtype=np.uint64)
    nan = words.view(np.float64).copy()
    nan[3] = float("nan")  # a measured NaN is a NaN, whatever the metric
    kept = screen_of(verdict)({"nan": nan, "grad_norm": np.full(4, 0.1)}, 4)
    assert kept.tolist() == [3]  # a True under nan reaches the verdict through the alarms


def test_audit_refuses_a_step_past_64_bits_in_the_callers_thread_and_loses_nothing():
    audit = Relay(interval=0.01, verdict=None)
    audit(health("enc", 0, grad_norm=0.5))
    with pytest.raises(ValueError, match="64 bits"):
        audit(health("enc", 1 << 70, grad_norm=0.5))
    with pytest.raises(ValueError, match="64 bits"):
        audit({"fact": "loss", "value": 1.0, "step": -(1 << 63) - 1})
    audit(health("enc", 1, grad_norm=10**400))  # past a float's range: kept as it is
    audit(health("enc", 2, grad_norm=0.25))
    time.sleep(0.05)  # the sender has turned the batch into columns meanwhile
    frame = audit.frame()
    assert frame["step"].tolist() == [0, 1, 2]
    assert frame["grad_norm"].tolist() == [0.5, 10**400, 0.25]
    assert audit.loss == []


def test_the_verdict_screen_keeps_every_row_the_verdict_would_flag():
    import numpy as np

    from somatize.figures._screen import screen_of
    from somatize.health import verdict

    screen = screen_of(verdict)
    edges = {
        "grad_norm": [0.0, 1e-8, 1e-7, 0.1, 1e3, 1e3 + 1e-9, 2e3, float("inf")],
        "zero": [0.0, 0.94, 0.95, 1.0],
        "saturated": [0.0, 0.49, 0.5],
        "update_ratio": [0.0, 9e-5, 1e-4, 1e-3, 1e-2, 0.02],
        "dead_channels": [0.0, 1.0, 3.0],
        "dormant_channels": [0.0, 2.0, 8.0],
        "channels": [4.0, 16.0],
        "cka": [0.0, 0.94, 0.95, 1.0],
        "effective_rank": [0.1, 0.4, 0.6, 5.0],
        "rank_room": [1.0, 2.0, 10.0],
        "mean": [0.0, float("nan"), -float("inf")],
    }
    rng = np.random.default_rng(0)
    rows = [
        {k: float(rng.choice(v)) for k, v in edges.items() if rng.random() < 0.7}
        for _ in range(4000)
    ]
    names = sorted(edges)
    missing = np.frombuffer(np.uint64(0x7FF8_534D_5A00_0001).tobytes(), dtype=np.float64)[0]
    columns = {n: np.array([r.get(n, missing) for r in rows]) for n in names}
    kept = set(screen(columns, len(rows)).tolist())
    flagged = {i for i, r in enumerate(rows) if verdict(r)}
    assert flagged and flagged <= kept
    assert len(kept) < len(rows)  # it does screen


def test_audit_answers_a_late_page_with_everything():
    audit = Relay(interval=0.01)
    for step in range(5):
        audit(health("enc", step, grad_norm=0.5))
        audit({"fact": "loss", "value": 2.0, "step": step})
    audit.sync()
    before = len(audit.outbox)
    audit._on_message(audit, {"kind": "hello"}, [])
    reset = audit.outbox[before]
    assert reset["kind"] == "reset" and reset["seq"] == audit._seq
    assert len(cells_of([reset])) == 5 and len(losses_of([reset])) == 5


def test_audit_picture_is_binned_to_240_steps_with_flags_kept():
    audit = Relay(interval=0.01)
    for step in range(1000):
        audit(health("enc", step, grad_norm=1e-9 if step == 501 else 0.5))
        audit({"fact": "loss", "value": 1.0, "step": step})
    for step in range(1000, 2500):  # more loss points than the picture keeps
        audit({"fact": "loss", "value": 1.0, "step": step})
    audit.sync()
    assert all("b64" in c for c in audit.picture["places"][0][2].values())  # a string each
    where, steps, columns, flagged = plain(audit.picture, [])["places"][0]
    assert len(steps) <= 240 and steps[-1] == 999 and len(columns["grad_norm"]) == len(steps)
    assert len(flagged) == 1 and flagged[0][1] == ["VANISHING"]  # one bin holds step 501
    loss_steps = plain(audit.picture, [])["loss"][0]
    assert len(loss_steps) <= 1001 and loss_steps[-1] == 2499


def test_audit_refuses_a_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        LiveAudit(interval=0)


# -- comparison ---------------------------------------------------------------------------
def test_compare_counts_parameters_and_keeps_measured():
    a = Graph.somatize(Lin(4, 8).named("a") >> Lin(8, 2).named("b"))
    b = Graph.somatize(Lin(4, 2).named("a"))
    df = compare({"two": a, "one": b}, torch.randn(3, 4), measured={"two": 0.9, "one": 0.5})
    assert list(df.index) == ["two", "one"] and df.index.name == "candidate"
    assert df.loc["two", "params"] == 4 * 8 + 8 + 8 * 2 + 2
    assert df.loc["one", "params"] == 4 * 2 + 2
    assert df.loc["one", "measured"] == 0.5
    with pytest.raises(ValueError, match="'three'"):
        compare({"two": a}, torch.randn(3, 4), measured={"three": 1.0})
    with pytest.raises(ValueError, match="at least one"):
        compare({}, torch.randn(3, 4))


def test_table_ranks_and_correlates_with_measured():
    df = pd.DataFrame(
        {"params": [10, 20, 30, 40], "proxy:a": [1.0, 2.0, 3.0, 4.0], "proxy:b": [4, 3, 2, 1]},
        index=["w", "x", "y", "z"],
    )
    table = CompareTable(df, measured={"w": 0.1, "x": 0.2, "y": 0.3, "z": 0.4})
    assert table.measured == "measured" and table.sort_by == "measured"
    assert table.correlations["proxy:a"] == pytest.approx(1.0)
    assert table.correlations["proxy:b"] == pytest.approx(-1.0)
    assert table.higher_better["proxy:a"] is True and table.higher_better["params"] is None
    assert table.data["values"][0] == [10, 1.0, 4, 0.1]
    with pytest.raises(ValueError, match="'acc' is not a column"):
        CompareTable(df, measured="acc")
    with pytest.raises(TypeError, match="DataFrame"):
        CompareTable({"a": 1})


def test_bundles_are_built_and_shipped():
    for name in ("graph", "audit", "table"):
        assert (STATIC / f"{name}.js").stat().st_size > 1000
        assert (STATIC / f"{name}.css").exists()
    assert "elk" in (STATIC / "graph.js").read_text()[:2_000_000].lower()


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
    assert full[[c for c in full.columns if c.startswith("proxy:")]].notna().all().all()
