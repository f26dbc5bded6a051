"""The live audit through its public API: the facts it takes and refuses, what it holds
(`frame`, `loss`), what it sends a page, what it draws (its static face), and a real kernel
where a fit fills a shown audit and its face is brought up to date when the cell ends."""

from __future__ import annotations

import base64
import math
import re
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from somatize.figures import LiveAudit
from somatize.health import METRICS, verdict

SVG = "{http://www.w3.org/2000/svg}"


class Relay(LiveAudit):
    """A LiveAudit whose messages are kept as the page gets them (there is no kernel here):
    each binary buffer read back as the float64 array it is."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outbox = []

    def send(self, content, buffers=None):
        arrays = [np.frombuffer(bytes(b), dtype="<f8") for b in buffers or []]
        self.outbox.append((content, arrays))


def health(node, step, inside=None, **numbers):
    return {"fact": "health", "node": node, "inside": inside, "step": step, **numbers}


def cells(outbox, metric):
    """(run, where, step) -> the metric's value, as the page reads the messages (None where
    the fact did not carry it)."""
    out = {}
    for content, arrays in outbox:
        for run in content["runs"]:
            for place in run["places"]:
                column = place["columns"].get(metric)
                values = list(arrays[column["buffer"]]) if column else [None] * len(place["steps"])
                for i in (column or {}).get("absent", []):
                    values[i] = None
                for step, v in zip(place["steps"], values, strict=True):
                    out[(run["run"], place["where"], step)] = v
    return out


def flags_sent(outbox):
    out = {}
    for content, _ in outbox:
        for run in content["runs"]:
            for entry in run.get("flags", []):
                for row, flags in entry["rows"]:
                    out[(run["run"], entry["where"], row)] = flags
    return out


def test_flat_facts_are_kept_as_given():
    audit = LiveAudit(interval=0.05)
    steps = [
        health("enc", 0, grad_norm=0.1, update_ratio=1e-3, nan=False, channels=16),
        health("enc", 1, grad_norm=float("nan"), update_ratio=1e-3, nan=True, channels=16),
        health("enc", 0, inside="fc", grad_norm=1e-12, update_ratio=1e-9),
        health("head", 0, zero_frac_max=0.99),  # other metrics: holes elsewhere
    ]
    for fact in steps:
        audit(fact)
    frame = audit.frame()
    assert list(frame["where"]) == ["enc", "enc", "enc.fc", "head"]
    assert list(frame.columns[:2]) == ["where", "step"] and frame.columns[-1] == "flags"
    assert frame.loc[1, "nan"] is True and frame.loc[0, "channels"] == 16  # types kept
    assert math.isnan(frame.loc[3, "grad_norm"]) and frame.loc[3, "zero_frac_max"] == 0.99
    assert audit.metrics == ["grad_norm", "update_ratio", "nan", "channels", "zero_frac_max"]
    assert "NAN" in frame.loc[1, "flags"] and frame.loc[0, "flags"] == []


def test_a_places_flags_at_its_last_step_are_what_diagnose_says_of_the_run(store):
    from somatize import Recorder
    from somatize.health import diagnose

    audit = LiveAudit(interval=0.05)
    recorder = Recorder(store, run="r")
    facts = []
    for step in range(60):
        facts.append(health("ok", step, grad_norm=0.05, update_ratio=1e-3, zero_frac_max=0.1))
        # a place that goes dead half way, and one with a passing spike at the start
        facts.append(
            health(
                "dies",
                step,
                grad_norm=0.05 if step < 30 else 1e-12,
                update_ratio=1e-3,
                zero_frac_max=0.1 if step < 30 else 1.0,
            )
        )
        facts.append(health("spike", step, grad_norm=0.05, update_ratio=0.5 if step < 3 else 1e-3))
    for fact in facts:
        audit(fact)
        recorder(fact)
    recorder.close()
    frame = audit.frame()
    last = {w: list(rows["flags"])[-1] for w, rows in frame.groupby("where")}
    said = {w: [str(f) for f in flags] for w, flags in diagnose(store, run="r").items()}
    assert {w: f for w, f in last.items() if f} == said  # one rule: the widget and diagnose agree
    assert last["ok"] == [] and last["dies"]  # and it says which place broke
    marked = frame[frame["where"] == "dies"]["flags"].map(bool).tolist()
    assert not any(marked[:30])  # no alarm before it broke


def test_the_layout_before_contract_1_is_still_read():
    audit = LiveAudit(interval=0.05)
    audit({"fact": "health", "where": "enc.fc", "step": 3, "numbers": {"grad_norm": 0.5}})
    assert audit.frame().to_dict("records") == [
        {"where": "enc.fc", "step": 3, "grad_norm": 0.5, "flags": []}
    ]


def test_a_malformed_fact_is_refused_in_the_callers_thread_and_nothing_of_it_kept():
    audit = LiveAudit(interval=0.05)
    with pytest.raises(ValueError, match="step"):
        audit(health("enc", 1.5, grad_norm=0.1))
    with pytest.raises(ValueError, match="node"):
        audit({"fact": "health", "step": 1, "grad_norm": 0.1})
    with pytest.raises(ValueError, match="64 bits"):
        audit(health("enc", 1 << 70, grad_norm=0.5))
    with pytest.raises(ValueError, match="64 bits"):
        audit({"fact": "loss", "value": 1.0, "step": -(1 << 63) - 1})
    assert audit.frame().empty and audit.metrics == [] and audit.loss == []
    audit({"fact": "ran", "node": "enc"})  # not a fact the audit draws: ignored
    audit(health("enc", np.int64(2), grad_norm=np.float32(0.25), note="a string is not drawn"))
    assert audit.frame().to_dict("records") == [
        {"where": "enc", "step": 2, "grad_norm": 0.25, "flags": []}
    ]
    with pytest.raises(ValueError, match="interval"):
        LiveAudit(interval=0)


def test_a_fact_is_kept_as_it_was_when_handed():
    audit = LiveAudit(interval=0.05)
    fact = health("enc", 0, grad_norm=0.5)
    audit(fact)
    fact["grad_norm"], fact["step"] = 9.0, 1  # the caller reuses its dict
    audit(fact)
    assert audit.frame()["grad_norm"].tolist() == [0.5, 9.0]


def test_what_is_new_goes_out_batched_as_binary_every_metric_at_once():
    audit = Relay(interval=0.2)
    began = time.monotonic()
    for step in range(300):
        audit({"fact": "loss", "value": 1.0 / (step + 1), "step": step})
        audit(health("enc", step, grad_norm=0.1 + step, update_ratio=1e-3))
        if step % 50 == 0:
            audit(health("enc", step, inside="fc", effective_rank=3.0))  # now and then
    took = time.monotonic() - began
    time.sleep(0.7)  # the rest goes once the interval has passed, with no other fact
    assert 1 <= len(audit.outbox) <= 3 + took / 0.2
    assert [m["seq"] for m, _ in audit.outbox] == list(range(1, len(audit.outbox) + 1))
    values = cells(audit.outbox, "grad_norm")
    assert len(values) == 306 and values[("", "enc", 299)] == 299.1
    assert cells(audit.outbox, "effective_rank")[("", "enc.fc", 50)] == 3.0
    # each message carries every metric of the rows it sends: a metric chosen on the page is
    # drawn from what it has, the kernel need not answer
    for content, _ in audit.outbox:
        for place in content["runs"][0]["places"]:
            assert set(place["columns"]) == (
                {"grad_norm", "update_ratio"} if place["where"] == "enc" else {"effective_rank"}
            )
    losses = [
        s for m, _ in audit.outbox for r in m["runs"] if "loss" in r for s in r["loss"]["steps"]
    ]
    assert losses == list(range(300))
    sent = len(audit.outbox)
    audit.metric = "update_ratio"
    assert len(audit.outbox) == sent  # nothing to resend


def test_the_flags_a_page_gets_follow_their_rows_as_they_are_judged():
    audit = Relay(interval=0.05)
    for step in range(40):
        audit(health("enc", step, grad_norm=1e-12 if step >= 10 else 0.1))  # it vanishes
    audit.sync()
    assert len(cells(audit.outbox, "grad_norm")) == 40
    sent = flags_sent(audit.outbox)
    held = {("", "enc", r): f for r, f in enumerate(audit.frame()["flags"]) if f}
    assert sent == held and any("VANISHING" in f for f in sent.values())  # what it holds


def test_two_runs_are_drawn_side_by_side():
    audit = LiveAudit(interval=0.05, title="adam")
    sgd = audit.run("sgd")
    for step in range(20):
        audit({"fact": "loss", "value": 2.0 - 0.05 * step, "step": step})
        sgd({"fact": "loss", "value": 2.3, "step": step})
        audit(health("enc", step, update_ratio=1e-3))
        sgd(health("enc", step, update_ratio=1e-12))
    frame = audit.frame()
    assert list(frame.columns[:3]) == ["run", "where", "step"] and set(frame["run"]) == {"", "sgd"}
    stalled = tuple(str(f) for f in verdict({"update_ratio": 1e-12}))  # the same numbers throughout
    assert stalled and set(frame[frame["run"] == "sgd"]["flags"].map(tuple)) == {stalled}
    assert set(frame[frame["run"] == ""]["flags"].map(tuple)) == {()}
    root = ET.fromstring(audit.svg())
    assert len(root.findall(f".//{SVG}path[@class='smz-loss']")) == 2  # a curve per run
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "run sgd" in texts and f"{stalled[0]} ×20" in texts
    assert "update_ratio" in texts and "not measured" in texts  # its health parts
    labels = [t.text for t in root.iter(f"{SVG}text") if t.find(f"{SVG}title") is not None]
    assert {"adam 1.05", "sgd 2.3"} <= set(labels)  # the unnamed run is named by the title
    with pytest.raises(ValueError, match="run is named"):
        audit.run("")


def face_of(audit):
    """The picture its HTML face shows (what a page with no kernel sees), parsed."""
    data, _ = audit._repr_mimebundle_()
    shown = re.search(r'base64,([^"]+)"', data["text/html"]).group(1)
    return ET.fromstring(base64.b64decode(shown))


def test_an_audit_of_losses_only_draws_a_loss_figure_each_curve_named_at_its_end():
    audit = LiveAudit(title="one curve per way", flags=False)
    long = "a rather long name for a way of training, cut on the right"
    ends = {"backprop": 0.0068, "Split": 0.0068, "Greedy": 0.0199, long: 0.111}
    for way, end in ends.items():
        watcher = audit.run(way)
        for step in range(1, 21):
            watcher({"fact": "loss", "step": step, "value": 2.0 * (end / 2.0) ** (step / 20)})
    root = face_of(audit)
    texts = [t for t in root.iter(f"{SVG}text")]
    said = " ".join("".join(t.itertext()) for t in texts)
    for health_part in ("waiting for health facts", "no metric yet", "not measured", "no number"):
        assert health_part not in said
    assert len(root.findall(f".//{SVG}path[@class='smz-loss']")) == 4
    labels = {}
    for t in texts:
        tip = t.find(f"{SVG}title")
        if tip is not None:
            labels[tip.text.split(": step")[0]] = t
    assert set(labels) == set(ends)  # each run's full name, in its label's tooltip
    assert labels["backprop"].text == "backprop 0.0068" and labels["Greedy"].text == "Greedy 0.0199"
    cut = labels[long].text
    assert cut.startswith("a rather long") and cut.endswith("… 0.111") and len(cut) < len(long)
    ys = sorted(float(t.get("y")) for t in labels.values())
    # two runs end at the same loss, yet their labels do not overlap
    assert min(b - a for a, b in zip(ys[:-1], ys[1:], strict=True)) >= 11
    assert [t.text for t in texts if t.text == "step"]  # the steps have their own axis
    data, _ = audit._repr_mimebundle_()
    assert 'alt="one curve per way: loss only, 20 steps, 4 runs"' in data["text/html"]


def test_a_runs_name_that_fits_at_the_end_of_its_curve_is_not_cut():
    audit = LiveAudit(title="two ways", flags=False)
    fits = "momentum sgd baseline"  # as wide as a label may be, less the width of a "…"
    for way in (fits, "adam"):
        watcher = audit.run(way)
        for step in range(5):
            watcher({"fact": "loss", "step": step, "value": 1.0 + step})
    texts = face_of(audit).iter(f"{SVG}text")
    labels = {
        t.find(f"{SVG}title").text: t.text for t in texts if t.find(f"{SVG}title") is not None
    }
    assert labels[f"{fits}: step 4: 5"] == f"{fits} 5" and labels["adam: step 4: 5"] == "adam 5"


def test_the_default_metric_is_the_update_ratio_where_it_is_measured():
    audit = LiveAudit(interval=0.05)
    audit(health("enc", 0, param_norm=3.0, grad_norm=0.1))
    audit.frame()
    assert audit.metric == "grad_norm"  # no update ratio yet
    audit(health("enc", 1, param_norm=3.0, grad_norm=0.1, update_ratio=1e-3))
    audit.frame()
    assert audit.metric == "update_ratio"
    chosen = LiveAudit(interval=0.05, metric="param_norm")
    chosen(health("enc", 0, param_norm=3.0, update_ratio=1e-3))
    chosen.frame()
    assert chosen.metric == "param_norm"  # what one chose stays chosen


def test_the_face_draws_the_chosen_metric_its_meaning_every_mark_and_real_axes():
    audit = LiveAudit(interval=0.05, title="mlp")
    for step in range(1000):
        audit({"fact": "loss", "value": 2.305 + 0.005 * math.sin(step), "step": step})
        audit(
            health(
                "enc",
                step,
                grad_norm=float("nan") if step == 501 else 0.1,
                update_ratio=1e-3,
                nan=step == 501,
            )
        )
    svg = audit.svg()
    root = ET.fromstring(svg)
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    assert "update_ratio" in text and METRICS["update_ratio"][:30] in text
    for key in ("not measured", "no number (NaN, ∞)", "flag: numeric"):
        assert key in text
    # a flat loss is drawn on an axis that says how flat: ticks a hundredth apart
    ticks = [
        t.text
        for t in root.iter(f"{SVG}text")
        if t.get("text-anchor") == "end" and t.text and t.text[0].isdigit()
    ]
    assert {"2.3", "2.31"} <= set(ticks) and "flat: it spans 0.01, 0.434% of its mean" in text
    cells_drawn = sum(
        p.get("d", "").count("z")
        for p in root.iter(f"{SVG}path")
        if p.get("fill", "").startswith("rgb(")
    )
    assert cells_drawn <= 240  # 1000 steps binned
    audit.metric = "grad_norm"
    assert "no number" in audit.svg() and 'fill="#e03131"' in audit.svg()  # the NaN, red
    data, _ = audit._repr_mimebundle_()
    assert (
        data["text/plain"].startswith("mlp: a live audit")
        and 'alt="mlp: 1 place, 1000 steps"' in data["text/html"]
    )
    shown = re.search(r'base64,([^"]+)"', data["text/html"]).group(1)
    assert base64.b64decode(shown).decode() == audit.svg()


def test_a_count_past_a_floats_range_is_drawn_as_no_number_as_the_page_gets_it():
    audit = LiveAudit(metric="tokens", flags=False)
    audit(health("enc", 0, tokens=10**400))  # an int a float cannot hold
    audit(health("enc", 1, tokens=3))
    audit(health("enc", 2, tokens=5))
    assert audit.frame()["tokens"].tolist() == [10**400, 3, 5]  # kept as it was given
    root = ET.fromstring(audit.svg())
    fills = [p.get("fill") for p in root.iter(f"{SVG}path") if p.get("d", "").startswith("M")]
    assert fills.count("#e03131") == 1  # its cell: no number, as the page draws "inf"
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    assert "tokens 3" in text and "5" in text  # the colour scale spans the numbers
    audit.settle()
    assert audit.record["runs"][0]["places"][0]["columns"]["tokens"]["values"] == ["inf", 3.0, 5.0]


def test_a_page_with_no_kernel_draws_from_a_thinned_record():
    audit = LiveAudit(interval=0.05)
    for step in range(3000):
        audit({"fact": "loss", "value": 1.0, "step": step})
        audit(health("enc", step, grad_norm=1e-12 if 1200 <= step < 1300 else 0.1))
    audit.settle()
    run = audit.record["runs"][0]
    place = run["places"][0]
    assert len(place["steps"]) <= 240 and place["steps"][-1] == 2999
    assert len(run["loss"]["steps"]) <= 2000
    rows = run["flags"][0]["rows"]
    assert rows and all(flags == ["VANISHING"] for _, flags in rows)
    assert all(1200 <= place["steps"][row] < 1340 for row, _ in rows)  # the bins that hold it


NOTEBOOK = [
    """
import torch
from torch import nn
from somatize import Graph, Node
from somatize.figures import LiveAudit
from somatize.torch import Audit, Trainer, parameters
class Layer(Node, nn.Module):
    def __init__(self, i, o):
        nn.Module.__init__(self)
        self.fc = nn.Linear(i, o)
    def forward(self, x, ctx=None):
        return torch.relu(self.fc(x))
torch.manual_seed(0)
g = Graph.somatize(Layer(8, 16).named("a") >> Layer(16, 3).named("b"))
audit = LiveAudit(title="shown first")
audit
""",
    """
t = Trainer(g, objective=nn.functional.cross_entropy, auditing=Audit(every=1),
            optimizer=torch.optim.SGD(parameters(g), lr=0.05), watching=audit)
data = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(12)]
t.fit(data, epochs=1)
print("fit", len(audit.frame()) > 0)
""",
]


def test_in_a_kernel_a_shown_audit_fills_during_a_fit_and_its_face_catches_up(tmp_path):
    from _children import in_a_kernel

    cells = in_a_kernel(NOTEBOOK, tmp_path)
    live, shown = cells[0].outputs  # the live view and its line, then the face on its own
    assert "application/vnd.jupyter.widget-view+json" in live.data and "text/html" not in live.data
    assert (
        live.data["text/plain"]
        == "shown first: a live audit of the watched places' health, step by step"
    )
    assert shown.output_type == "display_data" and list(shown.data) == [
        "text/html"
    ]  # updated later
    assert re.search(r'alt="shown first: \d+ places, 12 steps"', shown.data["text/html"])
    face = base64.b64decode(
        re.search(r'base64,([^"]+)"', shown.data["text/html"]).group(1)
    ).decode()
    assert "waiting for health facts" not in face and "update_ratio" in face
    assert "fit True" in cells[1].outputs[-1]["text"]


def test_a_loss_too_large_for_a_float_is_kept_as_infinity_and_the_audit_goes_on():
    audit = LiveAudit()
    for step, value in enumerate([2.5, 10**400, -(10**400), np.float32(1.5), "no number"]):
        audit({"fact": "loss", "step": step, "value": value})
    audit({"fact": "loss", "step": 5, "value": 0.5})
    assert audit.loss[:4] == [(0, 2.5), (1, math.inf), (2, -math.inf), (3, 1.5)]
    assert math.isnan(audit.loss[4][1]) and audit.loss[5] == (5, 0.5)
