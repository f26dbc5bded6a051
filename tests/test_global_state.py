"""torch's global settings as a researcher's notebook leaves them: a look (architecture, probe,
proxies, compare, a figure) and an Audit leave every one as it was, and draw nothing from the
user's random stream; a float64 default, anomaly mode and deterministic algorithms are
respected; a fit under no_grad or inference_mode is refused saying so. Every test puts back
what it sets (the `settings` fixture)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from models import zoo

from somatize import Graph
from somatize.figures import compare
from somatize.torch import Audit, ProxyLeftOut, Trainer, architecture, probe, proxies, proxy


@pytest.fixture
def settings():
    """Whatever a test sets of torch's global state is put back after it."""
    was = (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
        torch.get_num_threads(),
        torch.get_rng_state(),
        torch.get_float32_matmul_precision(),
    )
    try:
        yield
    finally:
        dtype, grad, det, warn_only, anomaly, nan, threads, rng, matmul = was
        torch.set_float32_matmul_precision(matmul)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.autograd.set_detect_anomaly(anomaly, check_nan=nan)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def global_state(model: torch.nn.Module) -> dict:
    """Every global setting a later training depends on, and each module's training flag."""
    return {
        "rng": torch.get_rng_state(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "threads": torch.get_num_threads(),
        "matmul": torch.get_float32_matmul_precision(),
        "training": {name: m.training for name, m in model.named_modules()},
    }


def assert_same_state(before: dict, after: dict, look: str) -> None:
    rng = before.pop("rng"), after.pop("rng")
    assert torch.equal(*rng), f"{look} moved the global random stream"
    assert after == before, f"{look} changed torch's global state"


def bert():
    """BERT at random init, with its dropout (what draws from the global stream), set to the
    mixed modes a notebook leaves: train mode, one attention block in eval."""
    case = zoo.bert()
    case.model.train()
    case.model.encoder.layer[0].attention.eval()
    return case


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(case, model: torch.nn.Module, audit: Audit | None = None, steps: int = 2):
    facts: list = []
    t = Trainer(
        model,
        objective=case.objective,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        auditing=audit,
        watching=facts.append,
    )
    t.fit([(case.example, case.target)] * steps)
    return t, facts


LOOKS = {
    "architecture": lambda c: architecture(Graph.somatize(c.model), c.example, depth=2),
    "probe": lambda c: probe(c.model, c.example, depth=1),
    "proxies": lambda c: proxies(c.model, c.example, target=c.target, objective=c.objective),
    "compare": lambda c: compare(
        {"bert": c.model}, c.example, target=c.target, objective=c.objective
    ),
    "figure": lambda c: (
        Graph.somatize(c.model).figure(inside=architecture(c.model, c.example)).svg()
    ),
}


@pytest.mark.parametrize("look", list(LOOKS))
def test_a_look_leaves_torchs_global_state_and_every_modules_mode_as_it_was(look, settings):
    case = bert()
    torch.set_num_threads(1)  # settings a notebook may have left, none torch's default
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(123)
    before = global_state(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProxyLeftOut)  # (BERT's example holds no float)
        LOOKS[look](case)
    assert_same_state(before, global_state(case.model), look)


@pytest.mark.parametrize("look", ["architecture", "probe", "proxies"])
def test_a_look_between_two_steps_changes_nothing_the_second_step_gives(look, settings):
    """Dropout draws from the global stream in both steps: a look between them that drew from
    it too would give the second step other masks."""
    case = bert()
    twin = copy.deepcopy(case.model)
    losses = []
    for model, looking in ((case.model, False), (twin, True)):
        t = Trainer(
            model, objective=case.objective, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
        torch.manual_seed(7)
        first = t.step((case.example, case.target))
        if looking:
            LOOKS[look](zoo.Case("bert", model, case.example, case.target, case.objective))
        losses.append((first, t.step((case.example, case.target))))
    assert losses[0] == losses[1]
    a, b = weights(case.model), weights(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _fits_around(between):
    """BERT's facts and weights after two audited fits, and after the same two fits of a twin
    with `between(case, graph, model)` run between them."""
    case = bert()
    runs = []
    for model, act in ((case.model, None), (copy.deepcopy(case.model), between)):
        g = Graph.somatize(model)  # one graph, trained and looked at, as in a notebook
        t = Trainer(
            g,
            objective=case.objective,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            auditing=Audit(every=1, channels=True, inside=True),
            watching=(facts := []).append,
        )
        torch.manual_seed(7)
        t.fit([(case.example, case.target)] * 2)
        if act is not None:
            act(case, g, model)
        t.fit([(case.example, case.target)] * 2)
        runs.append(([f for f in facts if f["fact"] in ("health", "loss")], weights(model)))
    return runs


@pytest.mark.parametrize("look", ["probe", "proxies"])
def test_a_look_between_two_audited_fits_is_not_heard_by_the_audit(look, settings):
    """The audit watching the net stays armed between fits for the next measured step: a look
    run then (its forward through |θ| for synflow, its backward) is not that step's, and the
    facts after it are those of a run without it."""

    def looks(case, g, model):
        LOOKS[look](zoo.Case("bert", g, case.example, case.target, case.objective))

    (plain, _), (looked, _) = _fits_around(looks)
    assert plain and looked == plain


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad"])
def test_an_evaluation_cell_between_audited_fits_changes_nothing_after_it(mode, settings):
    """net.eval() and a forward under no_grad or inference_mode, or with gradients on (no_grad
    forgotten), between two fits (a validation cell): the weights, the losses and the audit's
    facts after it are those of a run without."""

    def evaluates(case, g, model):
        model.eval()
        with getattr(torch, mode)():
            g.forward(case.example)
        model.train()
        model.encoder.layer[0].attention.eval()

    (plain, before), (evaluated, after) = _fits_around(evaluates)
    assert plain and evaluated == plain
    assert all(torch.equal(before[k], v) for k, v in after.items())


def test_an_audit_changes_nothing_in_the_fit_it_watches(settings):
    """The docs' claim: the same losses and weights, bit for bit, with or without an Audit;
    and after the fit the global stream and settings are where the unaudited fit left them."""
    case = bert()
    twin = copy.deepcopy(case.model)
    torch.manual_seed(5)
    plain, _ = fit(case, case.model)
    after_plain = global_state(case.model)
    torch.manual_seed(5)
    audited, facts = fit(case, twin, Audit(every=1, channels=True, inside=True))
    after_audited = global_state(twin)
    assert any(f.get("fact") == "health" for f in facts)
    assert audited.result.history == plain.result.history
    a, b = weights(case.model), weights(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_same_state(after_plain, after_audited, "an audited fit")


def test_a_float64_default_is_kept_by_forward_fit_audit_probe_store_and_export(settings, store):
    torch.set_default_dtype(torch.float64)
    case = bert()
    model = case.model
    assert all(p.dtype == torch.float64 for p in model.parameters())
    g = Graph.somatize(model)
    torch.manual_seed(0)
    out = g.forward(case.example)
    assert out.last_hidden_state.dtype == torch.float64

    # probe: a place's param_norm is its weights' norm in float64, to float64's rounding
    numbers = probe(model, case.example)
    (node,) = g.nodes()
    n = sum(p.numel() for p in model.parameters())
    rel = 8 * torch.finfo(torch.float64).eps * math.sqrt(n)  # (float32's would miss by 1e-7)
    norm = torch.linalg.vector_norm(torch.cat([p.flatten() for p in model.parameters()]))
    assert numbers[node]["param_norm"] == pytest.approx(norm.item(), rel=rel)

    # fit, audited: float64 weights, and the audit's param_norm (of the weights as the step
    # begins) read in float64
    facts: list = []
    t = Trainer(
        model,
        objective=case.objective,
        auditing=Audit(every=1),
        watching=facts.append,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    t.fit([(case.example, case.target)])
    norm = torch.linalg.vector_norm(torch.cat([p.flatten() for p in model.parameters()]))
    t.fit([(case.example, case.target)])
    assert all(p.dtype == torch.float64 for p in model.parameters())
    last = [f for f in facts if f.get("fact") == "health" and f.get("node") == node][-1]
    assert last["step"] == 1 and math.isfinite(last["grad_norm"])
    assert last["param_norm"] == pytest.approx(norm.item(), rel=rel)

    # export/load and keep/recall: float64 all the way
    exported = t.export()
    assert all(v.dtype == torch.float64 for v in exported[node].values() if v.is_floating_point())
    fresh = bert().model
    Trainer(
        fresh, objective=case.objective, optimizer=torch.optim.SGD(fresh.parameters(), 0.1)
    ).load(exported)
    for k, v in fresh.state_dict().items():
        assert v.dtype == exported[node][k].dtype and torch.equal(v, exported[node][k]), k
    store.keep("hidden", out.last_hidden_state.detach())
    back = store.recall("hidden")
    assert back.dtype == torch.float64 and torch.equal(back, out.last_hidden_state)


def test_anomaly_mode_and_deterministic_algorithms_on_fit_audit_and_probe_as_without(settings):
    case = bert()
    twin = copy.deepcopy(case.model)
    torch.manual_seed(3)
    plain, _ = fit(case, case.model, Audit(every=1))
    looked = probe(case.model, case.example)
    torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(True)
    torch.manual_seed(3)
    strict, facts = fit(case, twin, Audit(every=1))
    assert any(f.get("fact") == "health" for f in facts)
    assert strict.result.history == plain.result.history
    a, b = weights(case.model), weights(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert probe(twin, case.example) == looked


def test_probe_finds_a_nan_under_anomaly_mode_as_without_it(settings):
    """Anomaly mode is what a user turns on to find a NaN, and probe is where it says where:
    its own backward does not raise at the NaN it is there to report."""
    case = bert()
    with torch.no_grad():
        case.model.encoder.layer[1].output.dense.weight[0, 0] = float("nan")
    without = probe(case.model, case.example)
    torch.autograd.set_detect_anomaly(True)
    found = probe(case.model, case.example)
    assert torch.is_anomaly_enabled()
    assert found["bertmodel.encoder.layer.1.output.dense"]["nan"]
    assert not found["bertmodel.encoder.layer.0"]["nan"]
    assert found.keys() == without.keys()
    for where, numbers in without.items():  # (a NaN is not equal to itself: compared as text)
        assert repr(found[where]) == repr(numbers), where


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "inference_mode+enable_grad"])
def test_a_fit_under_no_grad_or_inference_mode_is_refused_saying_so(mode, settings):
    """Refused before anything runs, naming the mode and what to do; inference mode too where
    grad mode was turned back on inside it (torch.enable_grad() does not undo it)."""
    case = zoo.CASES["smallnet"]()  # (its BatchNorms' statistics move in any forward)
    t = Trainer(
        case.model,
        objective=case.objective,
        optimizer=torch.optim.SGD(case.model.parameters(), lr=0.1),
    )
    before = weights(case.model)
    rng = torch.get_rng_state()
    named = mode.split("+")[0]
    with getattr(torch, named)(), pytest.raises(RuntimeError) as refused:
        if mode.endswith("enable_grad"):
            torch.set_grad_enabled(True)
        t.fit([(case.example, case.target)])
    said = str(refused.value)
    assert f"torch.{named}()" in said and "outside" in said
    assert torch.equal(torch.get_rng_state(), rng)
    after = weights(case.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert t.result.history == []


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_look_under_no_grad_or_inference_mode_answers_as_outside_it(mode, settings):
    """A look reads the net and trains nothing: in a cell under torch.no_grad() or
    torch.inference_mode() it gives the same numbers, gradients' included, as outside."""
    case = bert()
    with pytest.warns(ProxyLeftOut):  # (zen and jacob_cov perturb a float input: BERT has none)
        outside = probe(case.model, case.example), proxies(case.model, case.example)
    drawn = architecture(case.model, case.example)
    with getattr(torch, mode)(), pytest.warns(ProxyLeftOut) as said:
        inside = probe(case.model, case.example), proxies(case.model, case.example)
        again = architecture(case.model, case.example)
        synflow = proxy(case.model, case.example, "synflow")
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == (mode == "inference_mode")
    assert sorted(w.message.proxy for w in said) == ["jacob_cov", "zen"]
    assert inside == outside and synflow == outside[1]["synflow"]
    assert {k: v.to_json() for k, v in again.items()} == {k: v.to_json() for k, v in drawn.items()}


def test_proxies_take_an_example_made_under_inference_mode(settings):
    """A data pipeline run under torch.inference_mode() gives inference tensors, which autograd
    cannot save: proxies answers on them as on the same values made outside it (probe does)."""
    case = bert()
    with torch.inference_mode():
        example = {k: v.clone() for k, v in case.example.items()}
        target = case.target.clone()
    with pytest.warns(ProxyLeftOut):  # (zen and jacob_cov perturb a float input: BERT has none)
        made = proxies(case.model, example, target=target, objective=case.objective)
        given = proxies(case.model, case.example, target=case.target, objective=case.objective)
    assert made == given
