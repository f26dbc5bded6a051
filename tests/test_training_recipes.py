"""What a user coming from Lightning does with a Trainer, on real models (transformers' ResNet
and GPT-2 at small configs, random init): mixed precision under one `torch.autocast`, a stop
at a loss that is not finite, a per-epoch scheduler on `Result.epochs`, and a run stopped and
resumed from a checkpoint (weights, optimizer, scheduler) that ends as the run never stopped.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from models import zoo

from somatize import Graph, Node
from somatize.torch import Audit, Trainer, named_parameters, parameters

BF16_EPS = 2.0**-8  # bfloat16's spacing at 1: a loss computed in it is good to a few of these
F32_EPS = torch.finfo(torch.float32).eps


def resnet_data(n=4):
    case = zoo.resnet()
    return case, [(case.example, case.target)] * n


def test_a_fit_under_one_autocast_trains_as_autocast_around_each_forward_by_hand():
    # The torch way puts autocast around each forward only: under one around the whole loop,
    # autocast's cache keeps the first cast of every weight, and the forward never sees an
    # update. A Trainer's step starts from the weights as they are, so `fit` may be wrapped.
    case, data = resnet_data()
    model = case.model
    hand = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    for x, y in data:
        hand.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = case.objective(model(x), y)
        loss.backward()
        hand.step()
        expected.append(loss.item())

    case, data = resnet_data()
    g = Graph.somatize(case.model)
    t = Trainer(g, objective=case.objective, optimizer=torch.optim.SGD(parameters(g), lr=0.5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        history = t.fit(data).history
    tol = 4 * BF16_EPS
    assert expected[0] - expected[-1] > 10 * tol * expected[0]  # the hand loop learnt
    assert history == pytest.approx(expected, rel=tol)


def test_finite_stops_at_a_nan_loss_before_its_backward_and_the_weights_stay_finite():
    case, _ = resnet_data()
    bad = case.example.clone()
    bad[0, 0, 0, 0] = float("nan")  # one corrupt pixel in the fourth batch
    good = (case.example, case.target)
    data = [good, good, good, (bad, case.target), good]
    g = Graph.somatize(case.model)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    with pytest.raises(TypeError, match="finite is True"):
        Trainer(g, objective=case.objective, optimizer=opt, finite="yes")
    t = Trainer(g, objective=case.objective, optimizer=opt, every=2, finite=True)
    updated = []
    opt.register_step_post_hook(lambda *a: updated.append(t.export()))
    with pytest.raises(
        FloatingPointError, match=r"step 3: the loss is nan.*this batch made it"
    ) as e:
        t.fit(data)
    # the forward took the batch into BatchNorm's running statistics as it ran: said, by name
    assert re.search(r"Buffers are not finite \(\S*running_mean", str(e.value))
    assert len(t.result.history) == 3 and all(map(math.isfinite, t.result.history))
    assert len(updated) == 1  # steps 0 and 1 made an update; step 2's group was dropped
    after = t.export()
    for name, _param in named_parameters(g):
        node, _, key = name.partition(".")
        assert torch.equal(after[node][key], updated[0][node][key]), name
    assert all(math.isfinite(loss) for loss in t.fit([good] * 2).history)  # and it goes on

    weight = case.model.classifier[1].weight
    with torch.no_grad():
        weight[0, 0] = float("inf")  # as an update from a gradient that was not finite leaves it
    with pytest.raises(FloatingPointError, match=r"not finite already \(\S*classifier.1.weight\)"):
        t.step(good)


def test_result_has_each_steps_time_and_each_epochs_mean_for_a_per_epoch_scheduler():
    case, data = resnet_data(3)
    g = Graph.somatize(case.model)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    t = Trainer(g, objective=case.objective, optimizer=opt)
    result = t.fit(data, epochs=2)
    assert len(result.seconds) == len(result.history) == 6 and min(result.seconds) > 0
    h = result.history
    assert result.epochs == pytest.approx([sum(h[:3]) / 3, sum(h[3:]) / 3], rel=4 * F32_EPS)
    assert f"{sum(result.seconds):.3g} s)" in repr(result)

    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for _ in range(2):  # the loss falls: the learning rate stays
        plateau.step(t.fit(data).epochs[-1])
    assert opt.param_groups[0]["lr"] == 0.1
    worse = [(x, (y + 1) % 5) for x, y in data]  # labels it did not learn
    plateau.step(t.fit(worse).epochs[-1])
    assert opt.param_groups[0]["lr"] == 0.05


def _gpt2_run(watching=None):
    """GPT-2 (dropout on), AdamW with no weight decay on biases and norms, a warmup and cosine
    schedule stepped at each update, two steps to an update; audited one step in three."""
    case = zoo.gpt2()
    g = Graph.somatize(case.model)
    named = named_parameters(g)
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * s / 8))
    )
    opt.register_step_post_hook(lambda *a: schedule.step())
    audit = Audit(every=3)
    t = Trainer(
        g, objective=case.objective, optimizer=opt, every=2, watching=watching, auditing=audit
    )
    return g, opt, schedule, t


def test_a_run_stopped_and_resumed_from_a_checkpoint_ends_as_the_run_that_never_stopped():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, zoo.VOCAB, (8, 4, zoo.SEQ), generator=gen)
    data = [({"input_ids": i}, i.roll(-1, 1)) for i in ids]

    facts = {"straight": [], "first": [], "resumed": []}
    _, _, schedule, t = _gpt2_run(facts["straight"].append)
    torch.manual_seed(42)  # dropout's
    straight = t.fit(data).history
    ended, lr = t.export(), schedule.get_last_lr()

    _, opt, schedule, t = _gpt2_run(facts["first"].append)
    torch.manual_seed(42)
    first = t.fit(data[:4]).history
    checkpoint = {
        "weights": t.export(),
        "optimizer": opt.state_dict(),
        "schedule": schedule.state_dict(),
        "rng": torch.get_rng_state(),
        "steps": t.steps,
    }
    del t, opt, schedule

    _, opt, schedule, t = _gpt2_run(facts["resumed"].append)  # as a fresh process builds it
    t.load(checkpoint["weights"], strict=True)
    opt.load_state_dict(checkpoint["optimizer"])
    schedule.load_state_dict(checkpoint["schedule"])
    torch.set_rng_state(checkpoint["rng"])
    t.steps = checkpoint["steps"]
    resumed = first + t.fit(data[4:]).history

    def steps(run, fact):
        return [f["step"] for f in facts[run] if f["fact"] == fact]

    for fact in ("loss", "updated", "health"):  # the steps go on, the audit's cadence too
        assert steps("first", fact) + steps("resumed", fact) == steps("straight", fact), fact
    assert set(steps("straight", "health")) == {0, 3, 6} and checkpoint["steps"] == 4

    assert straight[-1] != straight[0] and schedule.get_last_lr() == pytest.approx(lr)
    assert resumed == pytest.approx(straight, rel=16 * F32_EPS)
    for node, state in t.export().items():
        for key, value in state.items():
            assert torch.allclose(value, ended[node][key], rtol=0, atol=16 * F32_EPS), key


def test_a_frozen_backbone_is_unfrozen_the_way_the_docs_say_and_two_optimizers_are_refused():
    case = zoo.bert()
    bert = case.model
    head = torch.nn.Linear(32, 3)
    g = Graph.somatize(
        Node.of(bert).named("enc").frozen()
        >> Node.of(lambda out: out.last_hidden_state[:, 0]).named("cls")
        >> Node.of(head).named("head")
    )
    data = [(case.example, torch.tensor([0, 2]))] * 3
    loss = torch.nn.functional.cross_entropy
    two = [torch.optim.SGD(bert.parameters(), lr=0.1), torch.optim.Adam(head.parameters())]
    with pytest.raises(TypeError, match=r"one torch optimizer, not a list of 2.*Split"):
        Trainer(g, objective=loss, optimizer=two)
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    t = Trainer(g, objective=loss, optimizer=opt)
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    t.fit(data)
    assert not bert.training and all(
        torch.equal(v, before[k]) for k, v in bert.state_dict().items()
    )

    g.declare("enc", frozen=False)
    bert.requires_grad_(True)
    opt.add_param_group({"params": parameters(g, without=["head"]), "lr": 1e-3})
    t.fit(data)
    assert bert.training
    moved = bert.embeddings.word_embeddings.weight - before["embeddings.word_embeddings.weight"]
    assert moved.abs().max() > 1e-4  # Adam's first steps move a weight by about lr each
