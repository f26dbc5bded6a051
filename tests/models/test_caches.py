"""A model's key/value cache (what GPT-2 and T5 hand back while `use_cache` is on, their
default) written down and read back: from a worker, in a Split step, kept by a cached node."""

from __future__ import annotations

import copy

import pytest
import torch
import zoo
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from somatize import Broker, Graph, Node, Store, Worker
from somatize.torch import Split, Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")


def quiet(case: zoo.Case) -> nn.Module:
    """The case's model with its dropout off (so two runs of it can be compared)."""
    for m in case.model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return case.model


def held(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds, layer by layer (both caches of an encoder-decoder one)."""
    if isinstance(cache, EncoderDecoderCache):
        return held(cache.self_attention_cache) + held(cache.cross_attention_cache)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def tolerance(model: nn.Module) -> float:
    """How far a float32 run may be from a float64 one: a sum as wide as the model's widest
    row, once per layer it goes through."""
    width = max(p.shape[-1] for p in model.parameters())
    return 8 * width * model.config.num_hidden_layers * torch.finfo(torch.float32).eps


@pytest.fixture
def broker():
    broker = Broker.embedded({"gpu": Worker.spawn(["--threads", "1"], mode="network")})
    yield broker
    broker.close()


def test_gpt2_on_a_worker_answers_its_cache_as_the_one_computed_here(broker):
    case = zoo.gpt2()
    model = quiet(case)
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        here = reference(**case.example)
    there = Graph.somatize(Node.of(model).named("gpt2").at("gpu")).forward(
        case.example, broker=broker
    )
    assert type(there) is type(here)
    assert type(zoo.cache_of(there)) is DynamicCache
    tol = tolerance(model)
    pairs = [(there.logits, here.logits)]
    pairs += zip(held(zoo.cache_of(there)), held(zoo.cache_of(here)), strict=True)
    assert len(pairs) == 1 + 2 * model.config.n_layer
    for got, want in pairs:
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol)


def step(model: nn.Module, case: zoo.Case, broker: Broker | None) -> tuple[float, dict]:
    """One Split step of `model` (on the worker when a broker is given): its loss, its weights."""
    body = Node.of(model).named("body")
    g = Graph.somatize(body.at("gpu") if broker else body)
    trains = {"body": Split(torch.optim.SGD, lr=0.5)}
    t = Trainer(g, objective=case.objective, trains=trains, broker=broker)
    loss = t.step((case.example, case.target))
    return float(loss), t.export()["body"]


def test_a_split_step_of_gpt2_on_a_worker_equals_the_one_taken_here(broker):
    case = zoo.gpt2()
    model = quiet(case)
    reference = copy.deepcopy(model).double()
    before = copy.deepcopy(model.state_dict())
    want_loss, want = step(reference, case, None)
    got_loss, got = step(model, case, broker)
    tol = tolerance(model)
    assert got_loss == pytest.approx(want_loss, rel=tol)
    moved = [k for k, v in got.items() if not torch.equal(v, before[k])]
    assert "transformer.h.0.attn.c_attn.weight" in moved  # it was trained there, and came back
    for k, v in want.items():
        assert torch.allclose(got[k].double(), v, rtol=tol, atol=tol), k


@pytest.mark.parametrize("make", [zoo.gpt2, zoo.t5])
def test_a_cached_models_cache_comes_back_from_a_store_as_it_was_kept(make, tmp_path):
    case = make()
    model = case.model.eval()
    calls = []
    model.register_forward_hook(lambda m, a, o: calls.append(1))
    g = Graph.somatize(Node.of(model).named("lm").frozen().cached())
    first = g.forward(case.example, store=Store(tmp_path))
    second = g.forward(case.example, store=Store(tmp_path))  # read back from the directory
    assert len(calls) == 1
    kept, back = zoo.cache_of(first), zoo.cache_of(second)
    assert type(back) is type(kept) and type(back) in (DynamicCache, EncoderDecoderCache)
    assert len(held(back)) == len(held(kept)) > 0
    assert all(torch.equal(a, b) for a, b in zip(held(back), held(kept), strict=True))


def test_a_gpt2_cache_read_back_from_a_store_goes_on_as_the_one_kept(tmp_path):
    case = zoo.gpt2()
    model = case.model.eval()
    with torch.no_grad():
        out = model(**case.example)
    store = Store(tmp_path)
    store.keep("gpt2/out", out)
    back = zoo.cache_of(store.recall("gpt2/out"))
    ids, mask = case.example["input_ids"], case.example["attention_mask"]
    more = {"input_ids": ids[:, :1], "attention_mask": torch.cat([mask, mask[:, :1]], 1)}
    with torch.no_grad():
        went_on = model(**more, **{zoo.cache_name(out): zoo.cache_of(out)})
        goes_on = model(**more, **{zoo.cache_name(out): back})
    assert back.get_seq_length() == zoo.cache_of(went_on).get_seq_length() == ids.shape[1] + 1
    tol = tolerance(model)
    assert torch.allclose(goes_on.logits, went_on.logits, rtol=tol, atol=tol)
