"""A researcher training the families of models/more.py (Llama, Qwen2 with tied embeddings,
Whisper, wav2vec2, Swin, DeBERTa-v2, BART, DistilBERT; small configs, random init) with a
Trainer and an Audit, each run against a plain torch loop written by hand on a copy of the same
model (same init, same batches, same seeds): losses step for step, weights at the end, and the
audit's numbers against float64."""

from __future__ import annotations

import pytest
import torch
from models.more import CASES

from somatize import Graph, Node
from somatize.torch import Trainer, parameters

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
