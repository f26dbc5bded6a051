"""The newer families of models/newer.py (Mamba, Gemma 2, GPT-NeoX, ModernBERT, DINOv2,
SegFormer, EfficientNet; small configs, random init) used as a researcher would: trained by a
Trainer, cut into nodes, sent to a real worker process on 127.0.0.1 as code, their outputs kept
in a real Store, averaged; each against the same thing written in plain torch on a copy of the
same model (same init, same batches)."""

from __future__ import annotations

import copy

import pytest
import torch
from models.newer import CASES
from torch import nn

from somatize import Broker, Graph, Node, Worker
from somatize.codecs import NoCodec
from somatize.torch import Split, Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")

F64_EPS = torch.finfo(torch.float64).eps


def _still(model: nn.Module) -> nn.Module:
    """`model` in float64 with its dropout and drop path off, so that a run is the same in any
    process whatever its random stream."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if hasattr(m, "drop_prob"):  # SegFormer's and DINOv2's drop path
            m.drop_prob = 0.0
    return model.double()


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in float64 up to summation order (a worker runs on its own number of threads)."""
    return torch.allclose(a, b, rtol=0, atol=1e3 * F64_EPS * float(b.abs().max()))


@pytest.fixture(scope="module")
def broker():
    """One worker process that takes code (the model travels as it is), for the module."""
    with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as b:
        yield b


def test_a_model_that_ran_here_goes_to_a_worker_and_records_its_hidden_states_there(broker):
    # transformers records hidden states through hooks it installs on a model's first forward
    # that asks for them, and a table of what each class records that it fills in when a
    # model is built: a model sent after a forward here, and one unpickled where none of its
    # class was ever built, must both record there as here (SegFormer's decoder reads them)
    case = CASES["segformer"]()
    model = _still(case.model)
    x = case.example.double()
    with torch.no_grad():
        want = model(x).logits  # the hooks are on it now
        g = Graph.somatize(Node.of(model).named("seg").at("w"))
        assert _near(g.forward(x, broker=broker).logits, want)

    dino = _still(CASES["dinov2"]().model)
    x = CASES["dinov2"]().example.double()
    g = Graph.somatize(Node.of(dino).named("dino").at("w"))
    with torch.no_grad():
        there = g.forward({"pixel_values": x, "output_hidden_states": True}, broker=broker)
        here = dino(x, output_hidden_states=True)
    assert there.hidden_states is not None and len(there.hidden_states) == 3
    for a, b in zip(there.hidden_states, here.hidden_states, strict=True):
        assert _near(a, b)


def test_segformer_trained_by_split_on_a_worker_as_plain_torch_in_one_process(broker):
    case = CASES["segformer"]()
    model = _still(case.model)
    ref = copy.deepcopy(model)
    x, y = case.example.double(), case.target
    g = Graph.somatize(Node.of(model).named("seg").at("w"))
    t = Trainer(
        g,
        objective=case.objective,
        trains={"seg": Split(torch.optim.AdamW, lr=1e-2)},
        broker=broker,
    )
    losses = [t.step((x, y)) for _ in range(3)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = case.objective(ref(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e3 * F64_EPS)
    learnt = t.export()["seg"]
    for key, want in ref.state_dict().items():
        assert torch.allclose(learnt[key], want.to(learnt[key].dtype), rtol=0, atol=1e-9), key


def test_gemma2_on_a_worker_is_told_what_reaches_its_copy_there_and_then_trains_as_here(broker):
    # Gemma 2's cache holds sliding-window layers, which no public constructor takes back: its
    # output is refused at the worker, and the remedy it names must be one that reaches a
    # model already sent (its copy there follows the weights and modes here, not the config)
    case = CASES["gemma2"]()
    model = _still(case.model)
    ref = copy.deepcopy(model)
    g = Graph.somatize(Node.of(model).named("lm").at("w"))
    trains = {"lm": Split(torch.optim.AdamW, lr=1e-2)}
    t = Trainer(g, objective=case.objective, trains=trains, broker=broker)
    with pytest.raises(NoCodec, match=r"DynamicSlidingWindowLayer.*its input.*on a worker"):
        t.step((case.example, case.target))
    x = {**case.example, "use_cache": False}  # the remedy that reaches the worker
    losses = [t.step((x, case.target)) for _ in range(3)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = case.objective(ref(**x), case.target)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e3 * F64_EPS)
    learnt = t.export()["lm"]  # tied: the head and the embeddings one tensor there too
    assert torch.equal(learnt["lm_head.weight"], learnt["model.embed_tokens.weight"])
    assert _near(learnt["lm_head.weight"], ref.lm_head.weight.detach())
