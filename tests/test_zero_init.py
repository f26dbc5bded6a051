"""A layer initialised at zero is not dead: LoRA's B (peft's own init), and the last norm of a
residual branch set to zero (torchvision's `zero_init_residual`). Its output is all zeros at
first because its weights are, and its gradient moves them; `probe` and an audited training
must not call it DEAD, while a layer of dead ReLUs still is."""

from __future__ import annotations

import torch
from models.zoo import CASES, BasicBlock
from torch import nn

from somatize import Graph
from somatize.health import DEAD, Verdicts, verdict
from somatize.torch import Audit, Trainer, parameters, probe

LORA_B = "peftmodel.base_model.model.transformer.h.0.attn.c_attn.lora_B.default"


def _flagged(found: dict) -> dict[str, list]:
    return {where: flags for where, n in found.items() if (flags := verdict(n))}


def test_probe_does_not_call_lora_b_or_what_it_feeds_dead():
    case = CASES["lora"]()
    found = probe(case.model, case.example, most=400)
    assert found[LORA_B]["param_norm"] == 0.0 and found[LORA_B]["zero_frac_max"] == 1.0
    assert not _flagged(found), _flagged(found)


def _residual(zero_init: bool) -> nn.Module:
    torch.manual_seed(0)
    block = BasicBlock(4)
    if zero_init:  # torchvision's zero_init_residual: the branch starts as the identity
        nn.init.zeros_(block.bn2.weight)
    return block


def test_a_zero_initialised_residual_norm_is_measured_but_not_dead():
    x = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    found = probe(_residual(True), x)
    bn2 = found["basicblock.bn2"]
    assert bn2["zero_frac_max"] == 1.0 and bn2["param_norm"] == 0.0
    assert DEAD not in verdict(bn2)
    assert found["basicblock.bn1"]["param_norm"] > 0  # a norm's weights at their usual init
    plain = probe(_residual(False), x)
    assert plain["basicblock.bn2"]["zero_frac_max"] < 0.01


class _Dead(nn.Module):
    """A layer of ReLUs pushed negative by their bias, then a layer reading what they give."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        nn.init.constant_(self.lin.bias, -20.0)
        self.relu = nn.ReLU()
        self.after = nn.ReLU()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.after(self.relu(self.lin(x))))


def test_dead_relus_are_still_dead_and_only_where_they_die():
    torch.manual_seed(0)
    found = probe(_Dead(), torch.randn(6, 8, generator=torch.Generator().manual_seed(2)))
    assert DEAD in verdict(found["_dead.relu"])
    # what a place given only zeros gives back is its input's zeros: the flag names the cause
    assert "zero_frac_max" not in found["_dead.after"]
    assert DEAD not in verdict(found["_dead.after"])


def _audited(model: nn.Module, example, target, objective, steps: int, **audit) -> list[dict]:  # noqa: ANN001
    """The health facts of `steps` audited AdamW steps on the weights of `model` that train."""
    g = Graph.somatize(model)
    facts: list[dict] = []
    t = Trainer(
        g,
        objective=objective,
        optimizer=torch.optim.AdamW([q for q in parameters(g) if q.requires_grad], lr=1e-3),
        auditing=Audit(**audit),
        watching=facts.append,
    )
    for _ in range(steps):
        t.step((example, target))
    return [f for f in facts if f.get("fact") == "health"]


def test_an_audited_lora_fine_tune_never_calls_its_b_dead():
    case = CASES["lora"]()
    # past the first step, when B is all zero, inside the window (20)
    facts = _audited(case.model, case.example, case.target, case.objective, 6, inside=[LORA_B])
    b = [f for f in facts if f["inside"] and "lora_B" in f["inside"]]
    assert [f["step"] for f in b] == list(range(6))
    assert b[0]["param_norm"] == 0.0 and b[0]["zero_frac_max"] == 1.0  # measured, as it is
    assert all(f["param_norm"] > 0 and f["zero_frac_max"] < 0.5 for f in b[1:])
    assert not [f["step"] for f in b if DEAD in verdict(f)]


def test_frozen_weights_that_are_not_zero_still_show_dead_units():
    torch.manual_seed(0)
    net = _Dead()
    net.lin.requires_grad_(False)  # frozen, its bias −20: the ReLUs after it are dead
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    v = Verdicts().feed(_audited(net, x, y, nn.functional.cross_entropy, 3, inside=True))
    assert DEAD in v.flags().get("_dead.relu", []), v.flags()
