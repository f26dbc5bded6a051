"""A researcher training the families of models/more.py (Llama, Qwen2 with tied embeddings,
Whisper, wav2vec2, Swin, DeBERTa-v2, BART, DistilBERT; small configs, random init) with a
Trainer and an Audit, each run against a plain torch loop written by hand on a copy of the same
model (same init, same batches, same seeds): losses step for step, weights at the end, and the
audit's numbers against float64."""

from __future__ import annotations

import math

import pytest
import torch
from models.more import CASES

from somatize import Graph, Node
from somatize.torch import Audit, Trainer, freeze, parameters

F32_EPS = torch.finfo(torch.float32).eps


def _call(model, x):
    return model(**x) if isinstance(x, dict) else model(x)


def _piece(value, k, i):
    """The i-th of k pieces of a batch along its first dimension, as `micro=k` cuts it."""
    if isinstance(value, dict):
        return {key: v.chunk(k)[i] for key, v in value.items()}
    return value.chunk(k)[i]


def _last_hidden(out):
    return out.last_hidden_state


def _qwen2_in_nodes():
    """Qwen2 as three nodes, its embeddings (in 'body') and its output layer ('head') one
    tensor under two names, trained by one optimizer (no cut between them)."""
    case = CASES["qwen2"]()
    model = case.model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    g = Graph.somatize(
        Node.of(model.model).named("body")
        >> Node.of(_last_hidden).named("last")
        >> Node.of(model.lm_head).named("head")
    )
    return case, g


def test_qwen2_tied_across_two_nodes_trains_exports_both_names_and_refuses_two_values():
    case = CASES["qwen2"]()
    model = case.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = case.objective(
            model.lm_head(model.model(**case.example).last_hidden_state), case.target
        )
        loss.backward()
        opt.step()
        expected.append(loss.item())

    case, g = _qwen2_in_nodes()
    t = Trainer(g, objective=case.objective, optimizer=torch.optim.AdamW(parameters(g), lr=1e-2))
    assert t.fit([(case.example, case.target)] * 3).history == pytest.approx(
        expected, rel=16 * F32_EPS
    )
    for mine, theirs in zip(case.model.parameters(), model.parameters(), strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=16 * F32_EPS)

    saved = t.export()
    assert torch.equal(saved["body"]["embed_tokens.weight"], saved["head"]["weight"])
    t.load(saved, strict=True)
    differ = {"body": {"embed_tokens.weight": saved["head"]["weight"] + 1.0}, "head": saved["head"]}
    with pytest.raises(
        ValueError, match=r"'body'.*embed_tokens\.weight.*'head'.*weight.*one tensor"
    ):
        t.load(differ)
    after = t.export()  # refused whole: nothing moved
    assert all(torch.equal(after[n][k], saved[n][k]) for n in saved for k in saved[n])
    t.load({"head": {"weight": saved["head"]["weight"] + 1.0}})  # one name is both
    assert torch.equal(case.model.get_input_embeddings().weight, saved["head"]["weight"] + 1.0)


def _audited_swin(checkpointing):
    """Swin (drop path and dropout on) trained three steps under an Audit watching every module
    inside, each a snapshot; `checkpointing` None, or whether torch's checkpoint re-enters."""
    case = CASES["swin"]()
    if checkpointing is not None:
        case.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing}
        )
    g = Graph.somatize(case.model)
    facts = []
    audit = Audit(inside=True, most=100, snapshot=1, channels=True)
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    t = Trainer(g, objective=case.objective, optimizer=opt, auditing=audit, watching=facts.append)
    torch.manual_seed(3)  # drop path's and dropout's
    history = t.fit([(case.example, case.target)] * 3).history
    return (
        case.model,
        history,
        {(f["inside"], f["step"]): f for f in facts if f["fact"] == "health"},
    )


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_changes_nothing_the_audit_says(reentrant):
    # the checkpointed blocks run their forward again inside backward: Swin's blocks call one
    # Dropout twice, and a re-run that stops early (torch's non-reentrant checkpoint stops
    # once it has what backward needs) would be heard as a third call of the first
    plain, expected, told = _audited_swin(None)
    model, history, heard = _audited_swin(reentrant)
    assert history == pytest.approx(expected, rel=16 * F32_EPS)
    assert heard.keys() == told.keys()
    for where, fact in told.items():
        assert heard[where].keys() == fact.keys(), where
        for key, value in fact.items():
            if isinstance(value, float):  # float32, and a re-entered re-run rounds otherwise
                # (by hand in torch too): a slope, a difference of norms, to the norms' tolerance
                near = 1e-4 * fact["param_norm"] if key == "param_norm_slope" else 1e-9
                assert heard[where][key] == pytest.approx(value, rel=1e-4, abs=near), (where, key)
            else:
                assert heard[where][key] == value, (where, key)

    # and what the audit says is what a forward hook hears, in float64, without checkpointing
    case = CASES["swin"]()
    dropout = case.model.swin.encoder.layers[0].blocks[0].dropout
    outs = []
    dropout.register_forward_hook(lambda m, a, out: outs.append(out.detach().double()))
    torch.manual_seed(3)
    case.objective(case.model(case.example), case.target)
    assert len(outs) == 2  # called twice in each forward
    mean = sum(o.abs().sum() for o in outs) / sum(o.numel() for o in outs)
    where = ("swin.encoder.layers.0.blocks.0.dropout", 0)
    assert heard[where]["act_abs_mean"] == pytest.approx(float(mean), rel=1e-5)


def _distilbert_run(facts):
    """DistilBERT (dropout on) under AdamW and an Audit measuring every step, snapshots every
    four; `facts` hears everything."""
    case = CASES["distilbert"]()
    g = Graph.somatize(case.model)
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    audit = Audit(snapshot=4)
    t = Trainer(g, objective=case.objective, optimizer=opt, auditing=audit, watching=facts.append)
    return case, opt, t


def test_a_resumed_audited_run_takes_its_snapshots_where_the_run_that_never_stopped_does():
    straight: list = []
    case, _, t = _distilbert_run(straight)
    data = [(case.example, case.target)] * 8
    torch.manual_seed(5)
    expected = t.fit(data).history

    resumed: list = []
    _, opt, t = _distilbert_run(resumed)
    torch.manual_seed(5)
    first = t.fit(data[:6]).history
    saved = {"weights": t.export(), "optimizer": opt.state_dict(), "steps": t.steps}
    saved["rng"] = torch.get_rng_state()
    _, opt, t = _distilbert_run(resumed)  # as a fresh process builds it
    t.load(saved["weights"], strict=True)
    opt.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    t.steps = saved["steps"]
    assert first + t.fit(data[6:]).history == pytest.approx(expected, rel=16 * F32_EPS)

    def snapshots(facts):  # the steps whose facts hold the snapshot's numbers
        return [f["step"] for f in facts if f["fact"] == "health" and "effective_rank" in f]

    assert snapshots(straight) == [0, 4]  # every measured step, a snapshot every four
    assert snapshots(resumed) == snapshots(straight)


EVERY, MICRO = 2, 2


def _by_hand(case, data, bf16):
    """The plain torch loop: each batch cut in MICRO, autocast around each forward and its
    loss, the loss divided by EVERY * MICRO, AdamW every EVERY batches."""
    model = case.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s, (x, y) in enumerate(data):
        if s % EVERY == 0:
            opt.zero_grad()
        total = 0.0
        for i in range(MICRO):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = case.objective(_call(model, _piece(x, MICRO, i)), _piece(y, MICRO, i))
            (loss / (EVERY * MICRO)).backward()
            total += loss.item()
        losses.append(total / MICRO)
        if s % EVERY == EVERY - 1:
            opt.step()
    return losses


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_family_audited_under_every_micro_and_autocast_trains_as_the_hand_loop(name, bf16):
    # Llama's output carries a DynamicCache (use_cache left on), DeBERTa's and Llama's inputs
    # an attention mask cut with the batch, Swin draws drop path, Whisper and wav2vec2 take
    # audio; the audit watches every module inside and changes nothing
    case = CASES[name]()
    data = [(case.example, case.target)] * 4
    torch.manual_seed(3)  # dropout's and drop path's, the same draws in both runs
    expected = _by_hand(case, data, bf16)

    mine = CASES[name]()
    g = Graph.somatize(mine.model)
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    facts = []
    audit = Audit(inside=True, most=200)
    t = Trainer(
        g,
        objective=mine.objective,
        optimizer=opt,
        every=EVERY,
        micro=MICRO,
        auditing=audit,
        watching=facts.append,
    )
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        history = t.fit(data).history
    assert expected[-1] != expected[0]  # it moved
    # the same operations in the same order: float32's rounding, even under autocast
    assert history == pytest.approx(expected, rel=16 * F32_EPS)
    for a, b in zip(mine.model.parameters(), case.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=16 * F32_EPS)
    health = [f for f in facts if f["fact"] == "health"]
    heard = {(f["inside"], f["step"]) for f in health}
    places = {where for where, _ in heard}
    assert heard == {(where, step) for where in places for step in range(4)}
    (nid,) = g.nodes()
    watched = {w.removeprefix(nid + ".") for w in audit.places if w != nid}
    weighted = {path for path, m in mine.model.named_modules() if list(m.parameters())}
    assert {None} | (watched & weighted) <= places  # each place with weights, every step


TIED = {  # the places of Qwen2's and BART's one embedding tensor
    "qwen2": ["model.embed_tokens", "lm_head"],
    "bart": ["model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "lm_head"],
}


def _norm64(tensors):
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


@pytest.mark.parametrize(("name", "frozen"), [("qwen2", False), ("qwen2", True), ("bart", False)])
def test_the_audits_norms_and_update_ratios_of_tied_weights_are_float64_by_hand(name, frozen):
    # Qwen2's and BART's embeddings are their output layer: each place holding the tensor
    # counts it once, with the gradient of both uses; frozen (requires_grad_(False) on the
    # embeddings), it is neither trained nor measured, under either name
    case = CASES[name]()
    model = case.model
    if frozen:
        model.get_input_embeddings().requires_grad_(False)
    modules = dict(model.named_modules())

    def held(module):
        return [p for p in module.parameters() if p.requires_grad]

    opt = torch.optim.AdamW(held(model), lr=1e-2)
    data = [(case.example, case.target)] * 4
    want = {}
    torch.manual_seed(3)
    for s, (x, y) in enumerate(data):
        if s % EVERY == 0:
            opt.zero_grad()
            before = {k: [p.detach().double() for p in held(m)] for k, m in modules.items()}
        norms = {k: _norm64(held(m)) if held(m) else None for k, m in modules.items()}
        for i in range(MICRO):
            loss = case.objective(_call(model, _piece(x, MICRO, i)), _piece(y, MICRO, i))
            (loss / (EVERY * MICRO)).backward()
        for k, m in modules.items():
            grads = [p.grad for p in held(m) if p.grad is not None]
            want[k, s] = {"param_norm": norms[k], "grad_norm": _norm64(grads) if grads else None}
        if s % EVERY == EVERY - 1:
            opt.step()
            for k, m in modules.items():
                moved = _norm64([p.double() - b for p, b in zip(held(m), before[k], strict=True)])
                for done in range(s - EVERY + 1, s + 1):
                    if want[k, done]["param_norm"]:
                        want[k, done]["update_ratio"] = moved / want[k, done]["param_norm"]

    mine = CASES[name]()
    if frozen:
        mine.model.get_input_embeddings().requires_grad_(False)
    g = Graph.somatize(mine.model)
    facts = []
    t = Trainer(
        g,
        objective=mine.objective,
        optimizer=torch.optim.AdamW(parameters(g), lr=1e-2),
        every=EVERY,
        micro=MICRO,
        auditing=Audit(inside=True, most=200),
        watching=facts.append,
    )
    torch.manual_seed(3)
    t.fit(data)
    most = max(p.numel() for p in model.parameters())
    tol = 8 * F32_EPS * math.sqrt(most)
    health = [f for f in facts if f["fact"] == "health"]
    names = TIED[name]
    tied = [f for f in health if f["inside"] in names]
    assert len(tied) == 4 * len(names)  # each name a place, heard every step
    for step in range(4):  # one tensor: one norm under every name, or none frozen
        norms = {f.get("param_norm") for f in tied if f["step"] == step}
        assert len(norms) == 1 and (None in norms) == frozen
    for f in health:
        expected = want[f["inside"] or "", f["step"]]
        for key in ("param_norm", "grad_norm", "update_ratio"):
            if expected.get(key) is None:
                assert key not in f, (f["inside"], key)
            else:  # float32 sums of squares over at most `most` numbers, each way
                assert f[key] == pytest.approx(expected[key], rel=tol), (f["inside"], key)


def test_embeddings_unfrozen_after_a_warm_up_are_measured_from_then_on():
    # the docs' way to train a frozen part again: requires_grad_(True) and a param group for
    # it; the audit measures the weights a step trains, as it finds them at that step
    case = CASES["distilbert"]()
    model = case.model
    embeddings = model.get_input_embeddings()
    embeddings.requires_grad_(False)
    g = Graph.somatize(model)
    facts = []
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    audit = Audit(inside=["distilbertforsequenceclassification.distilbert.embeddings"])
    t = Trainer(g, objective=case.objective, optimizer=opt, auditing=audit, watching=facts.append)
    batch = (case.example, case.target)
    part = model.distilbert.embeddings  # the word embeddings, positions and a LayerNorm
    t.step(batch)
    trained = [p.detach().double().clone() for p in part.parameters() if p.requires_grad]
    t.step(batch)

    def at(step, inside):
        (fact,) = [
            f for f in facts if f["fact"] == "health" and (f["step"], f["inside"]) == (step, inside)
        ]
        return fact

    assert at(1, "distilbert.embeddings")["param_norm"] == pytest.approx(_norm64(trained))

    embeddings.requires_grad_(True)
    opt.add_param_group({"params": [embeddings.weight], "lr": 1e-3})
    start = [p.detach().double().clone() for p in part.parameters()]
    whole = [p.detach().double().clone() for p in model.parameters()]
    t.step(batch)
    fact = at(2, "distilbert.embeddings")
    tol = 8 * F32_EPS * math.sqrt(embeddings.weight.numel())
    assert fact["param_norm"] == pytest.approx(_norm64(start), rel=tol)
    assert fact["grad_norm"] == pytest.approx(_norm64([p.grad for p in part.parameters()]), rel=tol)
    moved = _norm64([p.double() - s for p, s in zip(part.parameters(), start, strict=True)])
    assert fact["update_ratio"] == pytest.approx(moved / _norm64(start), rel=tol)
    assert at(2, None)["param_norm"] == pytest.approx(_norm64(whole), rel=tol)


def test_inside_a_node_standing_twice_each_id_hears_only_its_own_calls():
    # one block applied twice (weights shared across depth, as ALBERT shares its layer): the
    # modules inside it are places of each id, each with its own call's numbers
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    g = Graph.somatize(
        Node.of(block).named("a")
        >> Node.of(lambda x: 10 * x).named("louder")
        >> Node.of(block).named("b")
    )
    facts = []
    audit = Audit(inside=True)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    t = Trainer(
        g,
        objective=lambda o, _: o.pow(2).mean(),
        optimizer=opt,
        auditing=audit,
        watching=facts.append,
    )
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # by hand, in float64, before the step moves the weights
        lin, act = block[0].double(), block[1]
        a0 = lin(x.double())
        b0 = lin(10 * act(a0))
        block.float()
    t.step((x, None))
    said = {(f["node"], f["inside"]): f["act_abs_mean"] for f in facts if f["fact"] == "health"}
    for (node, inside), out in [(("a", "0"), a0), (("b", "0"), b0)]:
        assert said[node, inside] == pytest.approx(float(out.abs().mean()), rel=64 * F32_EPS)
    assert said["b", "1"] == pytest.approx(float(act(b0).abs().mean()), rel=64 * F32_EPS)


def _first_output(out):
    """What a module gives: its tensor, or the first tensor of more than one number in what it
    gives back (an attention layer's output before its weights)."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out
    return next(t for t in items if isinstance(t, torch.Tensor) and t.dim())


@pytest.mark.parametrize("name", ["swin", "wav2vec2"])
def test_the_audits_activation_numbers_inside_are_float64_by_hand(name):
    # Swin's drop path and dropouts zero whole rows and single values, wav2vec2's convolutions
    # feed GELUs: every module inside, its mean |a| and its share of zeros over the step
    case = CASES[name]()
    heard = {}

    def hook(path):
        def keep(module, args, out):
            a = _first_output(out).detach().double()
            sums = heard.setdefault(path, [0.0, 0.0, 0])
            sums[0] += float(a.abs().sum())
            sums[1] += float((a.abs() <= 1e-7).sum())  # health.Thresholds().dead_eps
            sums[2] += a.numel()

        return keep

    for path, module in case.model.named_modules():
        if path:
            module.register_forward_hook(hook(path))
    torch.manual_seed(3)
    case.objective(_call(case.model, case.example), case.target).backward()

    mine = CASES[name]()
    g = Graph.somatize(mine.model)
    facts = []
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    audit = Audit(inside=True, most=300)
    t = Trainer(g, objective=mine.objective, optimizer=opt, auditing=audit, watching=facts.append)
    torch.manual_seed(3)
    t.step((mine.example, mine.target))
    inside = [f for f in facts if f["fact"] == "health" and f["inside"] is not None]
    assert {f["inside"] for f in inside} <= set(heard)  # named as torch names the module
    assert any(f["zero_frac_max"] > 0.05 for f in inside)  # (dropout at work)
    for f in inside:
        total, zeros, size = heard[f["inside"]]
        tol = 8 * F32_EPS * math.sqrt(size)  # float32 sums over `size` values
        assert f["act_abs_mean"] == pytest.approx(total / size, rel=tol), f["inside"]
        assert f["zero_frac_max"] == pytest.approx(zeros / size, abs=1.5 / size), f["inside"]


def _audited_wav2vec2(batches):
    """wav2vec2 under finite=True and an Audit inside, stepped by hand the way
    docs/training.md skips a batch whose loss is not finite; each step seeded alike."""
    case = CASES["wav2vec2"]()
    g = Graph.somatize(case.model)
    facts = []
    opt = torch.optim.AdamW(parameters(g), lr=1e-3)
    audit = Audit(inside=True, snapshot=1)
    t = Trainer(
        g,
        objective=case.objective,
        optimizer=opt,
        auditing=audit,
        watching=facts.append,
        finite=True,
    )
    losses = []
    for audio in batches(case.example):
        torch.manual_seed(7)  # dropout's, the same at every step of both runs
        try:
            losses.append(t.step((audio, case.target)))
        except FloatingPointError:
            continue  # skip it and go on
    return losses, [f for f in facts if f["fact"] == "health"]


def test_a_batch_skipped_for_a_nan_loss_leaves_nothing_in_the_audit_of_the_next_step():
    def clean(audio):
        return [audio, audio]

    def spoilt(audio):
        bad = audio.clone()
        bad[0, 5] = float("nan")
        return [audio, bad, audio]

    expected, told = _audited_wav2vec2(clean)
    losses, heard = _audited_wav2vec2(spoilt)
    assert losses == pytest.approx(expected, rel=16 * F32_EPS)
    assert [(f["inside"], f["step"]) for f in heard] == [(f["inside"], f["step"]) for f in told]
    for mine, theirs in zip(heard, told, strict=True):
        assert not mine["nan"], (mine["inside"], mine["step"])
        for key, value in theirs.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (mine["inside"], key)


def test_a_frozen_head_tied_to_trained_embeddings_is_refused_naming_both():
    # freezing Qwen2's output layer would freeze its input embeddings too, one tensor: the
    # body would train without them, silently
    case = CASES["qwen2"]()
    model = case.model
    g = Graph.somatize(
        Node.of(model.model).named("body")
        >> Node.of(_last_hidden).named("last")
        >> Node.of(model.lm_head).named("head").frozen()
    )
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    with pytest.raises(ValueError, match=r"'head' is frozen.*'body'.*embed_tokens\.weight.*tied"):
        Trainer(g, objective=case.objective, optimizer=opt)
    assert model.lm_head.weight.requires_grad and model.training  # nothing was settled
    # settled by hand first, as freeze(g) does before a Trainer: refused the same way
    with pytest.raises(ValueError, match=r"'head' is frozen.*'body'.*embed_tokens\.weight"):
        freeze(g)
    assert model.lm_head.weight.requires_grad and model.training
    unfrozen = Graph.somatize(
        Node.of(model.model).named("body") >> Node.of(model.lm_head).named("lm")
    )
    with pytest.raises(ValueError, match=r"'lm' is frozen.*'body'"):
        freeze(unfrozen, "lm")
    assert not unfrozen.setting("lm").frozen  # refused before it was declared

    head = model.lm_head  # as the refusal says: untied, the head frozen alone
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    t = Trainer(g, objective=case.objective, optimizer=torch.optim.AdamW(parameters(g), lr=1e-2))
    kept, before = (
        head.weight.detach().clone(),
        model.get_input_embeddings().weight.detach().clone(),
    )
    t.fit([(case.example, case.target)] * 2)
    assert torch.equal(head.weight, kept) and not head.weight.requires_grad
    assert not torch.equal(model.get_input_embeddings().weight, before)
