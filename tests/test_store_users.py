"""A researcher's frozen transformers encoder `.frozen().cached()` in front of a head, used as
one would: modes toggled, graphs built again, weights loaded; each answer checked against the
model run without a store, and each hit read from the facts the engine tells (`watching=`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import zoo

import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Graph, Node, Store

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
