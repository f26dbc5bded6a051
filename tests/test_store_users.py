"""A researcher's frozen transformers encoder `.frozen().cached()` in front of a head, used as
one would: modes toggled, graphs built again, weights loaded; each answer checked against the
model run without a store, and each hit read from the facts the engine tells (`watching=`)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from models import zoo

import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Graph, Node, Opaque, Store
from somatize.torch import freeze

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _caching(g: Graph, x, store: Store):
    said: list = []
    out = g.forward(x, store=store, watching=said.append)
    return out, [f.get("cache") for f in said if f["fact"] == "ran"]


def test_a_models_mode_when_its_graph_first_ran_is_not_in_its_key(tmp_path: Path) -> None:
    # the mode goes in the key at every forward; the one a graph first ran in must not stay
    # in it too, or a graph that first ran in train mode never finds what eval mode kept
    store = Store(tmp_path / "store")
    case = zoo.bert(dropout=0.0)  # train and eval compute the same: only the key can differ
    model, x = case.model, case.example
    model.requires_grad_(False)
    with torch.no_grad():
        want = model(**x).last_hidden_state
    first = Graph.somatize(Node.of(model).frozen().cached())
    model.train()
    assert _caching(first, x, store)[1] == ["miss"]
    model.eval()
    assert _caching(first, x, store)[1] == ["miss"]  # another mode: another key
    second = Graph.somatize(Node.of(model).frozen().cached())  # first runs in eval mode
    out, said = _caching(second, x, store)
    assert said == ["hit"]
    torch.testing.assert_close(out.last_hidden_state, want, rtol=1.3e-6, atol=1e-5)
    model.train()
    assert _caching(second, x, store)[1] == ["hit"]


class _Published(Node):
    """An encoder node written for the published package: what it hands on is wrapped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def forward(self, x, ctx):
        out = self.model(**x)
        return {"states": Opaque(out.last_hidden_state), "mask": Opaque(x["attention_mask"])}


class _PublishedMapped(_Published):
    def forward(self, xs, ctx):
        return [Opaque(self.model(**x).pooler_output) for x in xs]


def test_a_cached_nodes_output_holding_opaque_is_kept_as_what_it_wraps(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    case = zoo.bert()
    model, x = case.model, case.example
    model.eval().requires_grad_(False)
    with torch.no_grad():
        want = model(**x)
    g = Graph.somatize(_Published(model).frozen().cached())
    for expected in ("miss", "hit"):
        out, said = _caching(g, Opaque(x), store)
        assert said == [expected]
        torch.testing.assert_close(out["states"], want.last_hidden_state)
        assert torch.equal(out["mask"], x["attention_mask"])
    items = [{k: v[i : i + 1] for k, v in x.items()} for i in range(2)]
    mapped = Graph.somatize(_PublishedMapped(model).frozen().cached().mapped())
    for expected in ("miss", "hit"):
        out, said = _caching(mapped, items, store)
        assert said == [expected] and len(out) == 2
        for got, item in zip(out, items, strict=True):
            with torch.no_grad():
                torch.testing.assert_close(got, model(**item).pooler_output)


def test_a_model_that_ran_cached_still_saves_whole_and_its_graph_pickles(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    case = zoo.bert()
    model, x = case.model, case.example
    g = Graph.somatize(Node.of(model).frozen().cached())
    freeze(g)
    assert _caching(g, x, store)[1] == ["miss"]
    torch.save(model, tmp_path / "model.pt")  # the whole module, as some scripts keep it
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(again(**x).last_hidden_state, model(**x).last_hidden_state)
    unpickled = pickle.loads(pickle.dumps(g))
    out, said = _caching(unpickled, x, store)
    assert said == ["hit"]
    with torch.no_grad():
        torch.testing.assert_close(out.last_hidden_state, model(**x).last_hidden_state)
    held = unpickled.implementation("bertmodel").held  # the model the copy holds
    state = {k: v + 0.01 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    held.load_state_dict(state)  # a load into the unpickled copy still reaches its keys
    out, said = _caching(unpickled, x, store)
    assert said == ["miss"]
    with torch.no_grad():
        torch.testing.assert_close(out.last_hidden_state, held(**x).last_hidden_state)
