"""A researcher fine-tuning transformers' GPT-2 and T5 (small configs, random init) with a
Trainer, the way docs/training.md says: dict batches from a DataLoader with workers whose
collate_fn gives a BatchEncoding, `every=4` and `micro=2`, bfloat16 autocast, gradient clipping
and a warm-up schedule on the optimizer's hooks, no weight decay on biases and norms; each run
against the same loop written by hand in plain torch, with the same seeds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from models import zoo
from torch.nn.utils import clip_grad_norm_
from torch.utils.data import DataLoader
from transformers import BatchEncoding

from somatize import Graph
from somatize.torch import Trainer, named_parameters, parameters

DOCS = Path(__file__).resolve().parent.parent / "docs" / "training.md"
BF16_EPS = 2.0**-8
F32_EPS = torch.finfo(torch.float32).eps
ROWS, BATCH, EVERY, MICRO = 16, 4, 4, 2


def _rows(n):
    ids = torch.randint(1, zoo.VOCAB, (n, zoo.SEQ), generator=torch.Generator().manual_seed(3))
    return [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids
    ]


def _collate(items):
    return BatchEncoding({k: torch.stack([it[k] for it in items]) for k in items[0]}), None


def _loader(rows=ROWS):
    return DataLoader(_rows(rows), batch_size=BATCH, collate_fn=_collate, num_workers=2)


def _own_loss(out, _):
    return out.loss


def _grouped(named):
    """AdamW with weight decay on the matrices only, as docs/training.md builds it."""
    return torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def _clipped(opt, params):
    """Clips the gradient to norm 1 before each update, as docs/training.md does."""

    def clip(optimizer, args, kwargs):
        clip_grad_norm_(params, 1.0)

    opt.register_step_pre_hook(clip)


def _by_hand(model, opt, bf16, micro=MICRO, rows=ROWS):
    """The plain torch loop: each batch cut in MICRO, autocast around each forward, the loss
    divided by EVERY * micro, clipping to 1 then a step every EVERY batches. Answers each batch's
    loss and the norm each update clipped."""
    losses, norms = [], []
    for k, (x, _) in enumerate(_loader(rows)):
        if k % EVERY == 0:
            opt.zero_grad()
        total = 0.0
        for piece in range(micro):
            part = {key: v.chunk(micro)[piece] for key, v in x.items()}
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(**part).loss
            (loss / (EVERY * micro)).backward()
            total += loss.item()
        losses.append(total / micro)
        if k % EVERY == EVERY - 1:
            norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
    return losses, norms


def test_the_docs_clipping_recipe_as_written_clips_each_update_as_torch_does():
    # docs/training.md's block, run as a reader copies it (cross_entropy is theirs)
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if "clip" in b
    )
    case = zoo.gpt2()  # seeds torch: dropout draws the same in both runs
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    expected, norms = _by_hand(case.model, opt, False, micro=1)
    assert min(norms) > 1.0  # the clip is at work on every update

    case = zoo.gpt2()
    said = {"torch": torch, "Graph": Graph, "Trainer": Trainer, "parameters": parameters}
    said |= {"g": Graph.somatize(case.model), "cross_entropy": _own_loss}
    exec(block, said)
    assert said["t"].fit(_loader()).history == pytest.approx(expected, rel=16 * F32_EPS)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("make", [zoo.gpt2, zoo.t5], ids=["gpt2", "t5"])
def test_a_fine_tune_with_every_micro_clipping_decay_groups_and_warmup_is_the_hand_loop(make, bf16):
    model = make().model
    opt = _grouped(list(model.named_parameters()))
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    opt.register_step_post_hook(lambda o, a, k: warmup.step())
    torch.manual_seed(42)  # dropout's
    expected, _ = _by_hand(model, opt, bf16)
    lr = warmup.get_last_lr()

    g = Graph.somatize(make().model)
    opt = _grouped(named_parameters(g))
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    _clipped(opt, parameters(g))
    opt.register_step_post_hook(lambda o, a, k: warmup.step())
    t = Trainer(g, objective=_own_loss, optimizer=opt, every=EVERY, micro=MICRO)
    torch.manual_seed(42)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        result = t.fit(_loader())
    assert warmup.get_last_lr() == pytest.approx(lr) and len(result.history) == ROWS // BATCH
    # the same operations in the same order: float32's rounding, even under autocast
    assert result.history == pytest.approx(expected, rel=16 * F32_EPS)
    assert re.fullmatch(r"Result\(4 steps, loss \S+ → \S+, \S+ s\)", repr(result))


def test_a_model_held_in_bfloat16_reports_each_batchs_loss_as_the_mean_of_its_pieces():
    # T5's loss comes out in bfloat16 when the model is held in it: the batch's loss under
    # micro is the mean of the pieces' losses, not a mean rounded to bfloat16 on the way
    model = zoo.t5().model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42)
    expected, _ = _by_hand(model, opt, False)

    model = zoo.t5().model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _clipped(opt, list(model.parameters()))
    t = Trainer(model, objective=_own_loss, optimizer=opt, every=EVERY, micro=MICRO)
    torch.manual_seed(42)
    assert t.fit(_loader()).history == pytest.approx(expected, rel=4 * F32_EPS)


def _resumable():
    """GPT-2 under decay groups and clipping, its warm-up stepped by a watcher of `updated`."""
    g = Graph.somatize(zoo.gpt2().model)
    opt = _grouped(named_parameters(g))
    _clipped(opt, parameters(g))
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)

    def stepping(fact):
        if fact["fact"] == "updated":
            warmup.step()

    t = Trainer(
        g, objective=_own_loss, optimizer=opt, every=EVERY, micro=MICRO, watching=[stepping]
    )
    return opt, warmup, t


def test_a_run_stopped_mid_epoch_and_resumed_in_a_new_trainer_goes_on_loss_for_loss():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, warmup, t = _resumable()
        torch.manual_seed(42)  # dropout's
        straight = t.fit(_loader(2 * ROWS)).history
        ended, lr = t.export(), warmup.get_last_lr()

        opt, warmup, t = _resumable()
        torch.manual_seed(42)
        batches = iter(_loader(2 * ROWS))
        first = [t.step(next(batches)) for _ in range(EVERY)]  # one update, mid-epoch
        saved = {"weights": t.export(), "optimizer": opt.state_dict(), "steps": t.steps}
        saved |= {"schedule": warmup.state_dict(), "rng": torch.get_rng_state()}
        rest = list(batches)
        del t, opt, warmup

        opt, warmup, t = _resumable()
        t.load(saved["weights"], strict=True)
        opt.load_state_dict(saved["optimizer"])
        warmup.load_state_dict(saved["schedule"])
        torch.set_rng_state(saved["rng"])
        t.steps = saved["steps"]
        resumed = first + t.fit(rest).history
    assert len(first) == len(rest) == ROWS // BATCH and warmup.get_last_lr() == pytest.approx(lr)
    assert resumed == pytest.approx(straight, rel=16 * F32_EPS)
    for node, state in t.export().items():
        for key, value in state.items():  # weights of order 1: float32's spacing there
            assert torch.allclose(value, ended[node][key], rtol=16 * F32_EPS, atol=16 * F32_EPS)


def test_a_lora_fine_tune_under_one_autocast_is_autocast_around_each_forward_by_hand():
    # torch's recipe: autocast around the forward and the loss, the backward outside it. Run
    # under autocast, the backward of peft's LoRA layers computes other gradients
    model = zoo.lora().model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(42)
    expected, _ = _by_hand(model, opt, True, rows=2 * ROWS)

    g = Graph.somatize(zoo.lora().model)
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    _clipped(opt, parameters(g))
    t = Trainer(g, objective=_own_loss, optimizer=opt, every=EVERY, micro=MICRO)
    torch.manual_seed(42)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        history = t.fit(_loader(2 * ROWS)).history
    assert expected[-1] != expected[EVERY - 1]  # it moved
    assert history == pytest.approx(expected, rel=16 * F32_EPS)
