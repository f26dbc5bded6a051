"""The audit's flags on the fine-tuning recipes people run, on real models: a healthy run shows
no flag at any step, and a run broken on purpose is flagged at its cause.

Weights that start at zero (peft's LoRA B, Swin's relative position bias table, a residual
branch's last norm set to zero) are made only of their updates at first: after k updates of
about the same size ‖θ‖ ≈ k‖Δθ‖, so ‖Δθ‖/‖θ‖ ≈ 1/k whatever the learning rate (Adam's step is
about lr per weight, and so is ‖θ‖ it builds). Their update ratio says how many steps they
have had, not whether the step is too large, so it must not read OVERSTEPPING."""

from __future__ import annotations

import pytest
import torch
from models.more import CASES as MORE
from models.zoo import CASES, BasicBlock
from torch import nn

from somatize import Graph
from somatize.health import OVERSTEPPING, Verdicts, where_of
from somatize.torch import Audit, Trainer, parameters

LORA = "peftmodel.base_model.model.transformer.h.0.attn.c_attn.lora_{}.default"
TABLE = "swinforimageclassification.swin.encoder.layers.0.blocks.0.attention.relative_position_bias"


def _fine_tune(model, example, target, objective, *, lr, steps, warm=5, inside, window=20):  # noqa: ANN001
    """AdamW with linear warm-up over `warm` steps; the health facts, the flags each place held
    at any step (`Verdicts`, what a live audit marks), and the losses."""
    g = Graph.somatize(model)
    opt = torch.optim.AdamW(parameters(g), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm))
    facts: list[dict] = []
    t = Trainer(
        g,
        objective=objective,
        optimizer=opt,
        auditing=Audit(inside=inside, window=window),
        watching=facts.append,
    )
    losses = []
    for _ in range(steps):
        losses.append(float(t.step((example, target))))
        sched.step()
    t.close()
    health = [f for f in facts if f.get("fact") == "health"]
    v, ever = Verdicts(), {}
    for f in health:
        for flag in v.add(f) or ():
            ever.setdefault(where_of(f), set()).add(str(flag))
    return health, ever, losses


def _of(health: list[dict], where: str) -> list[dict]:
    return [f for f in health if where_of(f) == where]


def test_a_lora_fine_tune_with_warm_up_raises_no_flag_and_its_b_gets_no_ratio_while_it_grows():
    case = CASES["lora"]()
    a, b = LORA.format("A"), LORA.format("B")
    health, ever, losses = _fine_tune(
        case.model, case.example, case.target, case.objective, lr=3e-3, steps=16, inside=[a, b]
    )
    assert sum(losses[-4:]) < sum(losses[:4])  # (GPT-2's dropout makes each loss noisy)
    assert not ever, ever
    bs = _of(health, b)
    assert [f["step"] for f in bs] == list(range(16))
    assert all(f["param_norm"] > 0 and f["grad_norm"] > 0 for f in bs[1:])  # measured
    assert not [f["step"] for f in bs if "update_ratio" in f]  # growing from zero: no size yet
    # A started with a size of its own: its ratio is said at every step
    assert all(0 < f["update_ratio"] < 0.25 for f in _of(health, a))


def test_a_lora_lr_a_hundred_times_too_high_is_flagged_on_a():
    case = CASES["lora"]()
    a, b = LORA.format("A"), LORA.format("B")
    _, ever, _ = _fine_tune(
        case.model, case.example, case.target, case.objective, lr=1e-1, steps=8, inside=[a, b]
    )
    assert OVERSTEPPING in ever.get(a, set()), ever


def test_swins_zero_initialised_position_bias_table_is_not_overstepping():
    case = MORE["swin"]()
    health, ever, losses = _fine_tune(
        case.model, case.example, case.target, case.objective, lr=1e-3, steps=12, inside=[TABLE]
    )
    assert losses[-1] < losses[0]
    assert OVERSTEPPING not in ever.get(TABLE, set()), ever
    assert _of(health, TABLE)[0]["param_norm"] == 0.0  # (it does start at zero)


def test_a_zero_initialised_residual_norm_gets_its_ratio_once_grown_and_it_is_the_true_one():
    torch.manual_seed(0)
    block = BasicBlock(4)
    nn.init.zeros_(block.bn2.weight)  # torchvision's zero_init_residual (its bias is 0 too)
    g = Graph.somatize(block)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, 6, 6, generator=gen), torch.randn(8, 4, 6, 6, generator=gen)
    facts: list[dict] = []
    t = Trainer(
        g,
        objective=nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(g), lr=0.05, momentum=0.9),
        auditing=Audit(inside=["basicblock.bn2"], window=4),
        watching=facts.append,
    )
    by_hand = []
    for _ in range(10):
        was = torch.cat([p.detach().double().flatten() for p in block.bn2.parameters()])
        t.step((x, y))
        now = torch.cat([p.detach().double().flatten() for p in block.bn2.parameters()])
        by_hand.append(float((now - was).norm() / was.norm()) if was.norm() > 0 else None)
    t.close()
    bn2 = _of([f for f in facts if f.get("fact") == "health"], "basicblock.bn2")
    said = {f["step"]: f["update_ratio"] for f in bn2 if "update_ratio" in f}
    # zero at step 0, then four measured steps (the audit's window) to grow a size of its own
    assert sorted(said) == list(range(5, 10))
    for step, ratio in said.items():
        assert ratio == pytest.approx(by_hand[step], rel=1e-4)
    v = Verdicts().feed(bn2)
    assert not v.flags()


def _flagged_at_step_0(model, example, target, objective, steps: int = 1) -> dict[str, list]:  # noqa: ANN001
    g = Graph.somatize(model)
    facts: list[dict] = []
    t = Trainer(
        g,
        objective=objective,
        optimizer=torch.optim.AdamW(parameters(g), lr=1e-3),
        auditing=Audit(inside=True, most=400),
        watching=facts.append,
    )
    for _ in range(steps):
        t.step((example, target))
    t.close()
    v = Verdicts()
    for f in facts:
        v.add(f)
    return v.flags()


def test_a_nan_in_one_llama_weight_is_flagged_there_and_not_where_it_spread():
    case = MORE["llama"]()
    with torch.no_grad():  # one weight of the second layer's query projection
        case.model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    flagged = _flagged_at_step_0(case.model, case.example, case.target, case.objective)
    # it reaches the residual stream through sums and products no place makes (x + attn(x),
    # act(gate) * up, a slice before lm_head): each place it reaches that way inherited it
    assert flagged == {"llamaforcausallm.model.layers.1.self_attn.q_proj": ["NAN"]}


def test_dead_units_in_distilberts_ffn_are_flagged_where_they_die_not_where_their_zeros_go():
    case = MORE["distilbert"]()
    with torch.no_grad():  # GELU(x − 20) is 0 in float32: the first layer's ffn is dead
        case.model.distilbert.transformer.layer[0].ffn.lin1.bias.fill_(-20.0)
    flagged = _flagged_at_step_0(case.model, case.example, case.target, case.objective, 3)
    ffn = "distilbertforsequenceclassification.distilbert.transformer.layer.0.ffn."
    # its dropout and lin2 (its bias at 0) are handed only zeros and give them back
    assert flagged == {ffn + "activation": ["DEAD"]}
