"""The audit on real models, where what a fresh model is must not read as a fault: a fresh
transformer's attention (ViT, Swin at their own N(0, 0.02) init) is uniform, so every token of
an image gets the same mix and its output spans few directions from the first look; that is not
NARROWING, while a layer that collapses during training still is. A frozen Swin's relative
position table, all zero at its init, gives zeros that are its weights', not dead units. And a
part replaced mid-run (`resize_token_embeddings`' new lm_head) is named in a warning,
and a weight pruned and made permanent, which is the same weight, is not."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import more, zoo
from torch import nn
from torch.nn.utils import prune

from somatize import Graph
from somatize.health import DEAD, NARROWING, Verdicts
from somatize.torch import Audit, Trainer, parameters


def _trainer(model: nn.Module, objective, opt=torch.optim.AdamW, lr=1e-3, **audit) -> tuple:  # noqa: ANN001
    """A Trainer auditing `model` (`opt` on the weights that train), and the facts it hands on."""
    g = Graph.somatize(model)
    facts: list[dict] = []
    trained = [q for q in parameters(g) if q.requires_grad]
    t = Trainer(
        g,
        objective=objective,
        optimizer=opt(trained, lr=lr),
        auditing=Audit(**audit),
        watching=facts.append,
    )
    return t, facts


def _audit(model: nn.Module, example, target, objective, steps: int = 3, **audit) -> Verdicts:  # noqa: ANN001
    t, facts = _trainer(model, objective, **audit)
    for _ in range(steps):
        t.step((example, target))
    return Verdicts().feed(facts)


def test_a_fresh_vit_and_swin_attention_is_narrow_by_make_not_narrowing():
    for case in (zoo.vit(), more.swin()):
        v = _audit(
            case.model,
            case.example,
            case.target,
            case.objective,
            3,
            inside=True,
            most=400,
            snapshot=1,
        )
        n = v.numbers()
        narrow = [
            w
            for w, x in n.items()
            if "effective_rank" in x and x["effective_rank"] < 0.05 * x["rank_room"]
        ]
        assert any(w.endswith("attention.o_proj") for w in narrow), (case.name, narrow)
        assert all(n[w]["rank_share_start"] < 0.05 for w in narrow)
        assert not [w for w, flags in v.flags().items() if NARROWING in flags], case.name


class _Collapsing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


def test_a_layer_that_collapses_during_training_reads_narrowing():
    torch.manual_seed(0)
    net = _Collapsing()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 16, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    t, facts = _trainer(
        net, nn.functional.cross_entropy, torch.optim.SGD, 1e-2, inside=True, snapshot=1
    )
    for _ in range(3):
        t.step((x, y))
    assert not Verdicts().feed(facts).flags()
    with torch.no_grad():  # every unit now computes the same thing: the output spans one direction
        net.lin.weight.copy_(net.lin.weight[:1].expand_as(net.lin.weight))
        net.lin.bias.fill_(0.0)
    for _ in range(25):
        t.step((x, y))
    flags = Verdicts().feed(facts).flags()
    assert NARROWING in flags["_collapsing.lin"], flags


def test_a_part_replaced_mid_run_is_named_in_a_warning_and_release_stops_it():
    case = more.llama()  # untied: resizing gives it a new lm_head, module and weight
    t, _ = _trainer(case.model, case.objective, inside=True, most=400)
    t.step((case.example, case.target))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same weights given again: nothing to say
        case.model.model.embed_tokens.weight = case.model.model.embed_tokens.weight
        # a layer pruned, then made permanent: its own weight held as weight_orig, then as
        # weight again (the optimizer's, which goes on training it)
        query = case.model.model.layers[0].self_attn.q_proj
        w = query.weight
        prune.l1_unstructured(query, "weight", 0.5)
        t.step((case.example, case.target))
        prune.remove(query, "weight")
        assert query.weight is w
    with pytest.warns(UserWarning, match=r"node 'llamaforcausallm': 'lm_head' was given a new"):
        case.model.resize_token_embeddings(zoo.VOCAB + 8, mean_resizing=False)
    with pytest.warns(UserWarning, match=r"'model.norm.weight' was given a new weight"):
        case.model.model.norm.weight = nn.Parameter(torch.ones(32))
    t.close()  # the audit released: its hooks are gone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        case.model.resize_token_embeddings(zoo.VOCAB + 16, mean_resizing=False)


def test_a_frozen_swin_relative_position_table_at_zero_is_not_dead():
    case = more.swin()
    for name, q in case.model.named_parameters():
        if name.endswith("relative_position_bias_table"):  # all zero at Swin's own init
            assert not q.any()
            q.requires_grad_(False)
    v = _audit(case.model, case.example, case.target, case.objective, inside=True, most=400)
    tables = {w: n for w, n in v.numbers().items() if w.endswith("relative_position_bias")}
    assert len(tables) == 3  # measured, one a block, giving all zeros
    assert all(n["act_abs_mean"] == 0.0 and "zero_frac_max" not in n for n in tables.values())
    assert not [w for w, flags in v.flags().items() if DEAD in flags]
