"""The newer families of models/newer.py (Mamba, Gemma 2, GPT-NeoX, ModernBERT, DINOv2,
SegFormer, EfficientNet; small configs, random init) used as a researcher would: trained by a
Trainer, cut into nodes, sent to a real worker process on 127.0.0.1 as code, their outputs kept
in a real Store, averaged; each against the same thing written in plain torch on a copy of the
same model (same init, same batches)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from models.newer import CASES
from test_training_more_models import _call, _piece
from torch import nn

from somatize import Broker, Graph, Node, Store, Worker
from somatize.codecs import NoCodec
from somatize.torch import Split, Trainer, freeze, gather, parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")

F64_EPS = torch.finfo(torch.float64).eps
F32_EPS = torch.finfo(torch.float32).eps


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


def _scheduled(params):
    """AdamW with a one-cycle schedule stepped at each update (on the optimizer's post hook)."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=4)
    opt.register_step_post_hook(lambda *_: schedule.step())
    return opt


@pytest.mark.parametrize("name", ["mamba", "gemma2", "gpt_neox", "modernbert", "dinov2"])
def test_every_micro_finite_and_a_schedule_train_as_the_loop_written_by_hand(name):
    case = CASES[name]()
    ref = copy.deepcopy(case.model)
    data = [(case.example, case.target)] * 4
    opt = _scheduled(ref.parameters())
    expected = []
    torch.manual_seed(1)  # dropout's
    for s, (x, y) in enumerate(data):
        if s % 2 == 0:
            opt.zero_grad()
        total = 0.0
        for i in range(2):
            loss = case.objective(_call(ref, _piece(x, 2, i)), _piece(y, 2, i))
            (loss / 4).backward()
            total += loss.item()
        expected.append(total / 2)
        if s % 2 == 1:
            opt.step()

    g = Graph.somatize(case.model)
    opt = _scheduled(parameters(g))
    t = Trainer(g, objective=case.objective, optimizer=opt, every=2, micro=2, finite=True)
    torch.manual_seed(1)
    assert t.fit(data).history == pytest.approx(expected, rel=16 * F32_EPS)
    assert opt.param_groups[0]["lr"] != 1e-2  # the schedule moved, twice, as by hand
    for mine, theirs in zip(case.model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=16 * F32_EPS)


@pytest.mark.parametrize("name", ["segformer", "efficientnet"])
def test_a_batch_norm_model_is_refused_micro_and_trains_whole_batches_as_by_hand(name):
    case = CASES[name]()
    ref = copy.deepcopy(case.model)
    g = Graph.somatize(case.model)
    with pytest.raises(ValueError, match=r"micro=2 .*BatchNorm2d.*Use micro=1"):
        Trainer(g, objective=case.objective, optimizer=_scheduled(parameters(g)), micro=2)
    t = Trainer(g, objective=case.objective, optimizer=_scheduled(parameters(g)), finite=True)
    torch.manual_seed(2)
    history = t.fit([(case.example, case.target)] * 3).history
    opt = _scheduled(ref.parameters())
    torch.manual_seed(2)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = case.objective(ref(case.example), case.target)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert history == pytest.approx(expected, rel=16 * F32_EPS)
    for key, want in ref.state_dict().items():  # running statistics too
        assert torch.allclose(t.export()[g.nodes()[0]][key], want, rtol=0, atol=16 * F32_EPS)


class Embeds(nn.Module):
    """A causal LM's embeddings on its input's token ids, handing on the rest of its input
    (the attention mask) for the body, which takes the embeddings as `inputs_embeds`."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, x: dict) -> dict:
        rest = {k: v for k, v in x.items() if k != "input_ids"}
        return {"inputs_embeds": self.embed(x["input_ids"]), **rest}


def _last_hidden(out):
    return out.last_hidden_state


def _gemma2_in_nodes():
    """Gemma 2 cut as a researcher cuts it: embeddings >> body >> last hidden state >> head,
    its input embeddings (in 'emb' and in 'body') and its output layer ('head') one tensor."""
    case = CASES["gemma2"]()
    model = case.model
    model.config.use_cache = False
    g = Graph.somatize(
        Node.of(Embeds(model.model.embed_tokens)).named("emb")
        >> Node.of(model.model).named("body")
        >> Node.of(_last_hidden).named("last")
        >> Node.of(model.lm_head).named("head")
    )
    opt = torch.optim.AdamW(parameters(g), lr=1e-2)
    return case, opt, Trainer(g, objective=case.objective, optimizer=opt)


def test_gemma2_in_nodes_trains_as_by_hand_and_resumes_from_a_checkpoint_in_a_store(tmp_path):
    case, _, t = _gemma2_in_nodes()
    ref = copy.deepcopy(case.model)
    data = [(case.example, case.target)] * 4
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = []
    for x, y in data:
        opt.zero_grad()
        h = ref.model(
            inputs_embeds=ref.model.embed_tokens(x["input_ids"]),
            **{"attention_mask": x["attention_mask"]},
        )
        loss = case.objective(ref.lm_head(h.last_hidden_state), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert t.fit(data).history == pytest.approx(expected, rel=16 * F32_EPS)

    case, opt, t = _gemma2_in_nodes()
    first = t.fit(data[:2]).history
    Store(tmp_path).keep(
        "ckpt", {"weights": t.export(), "optimizer": opt.state_dict(), "steps": t.steps}
    )
    saved = Store(tmp_path).recall("ckpt")  # as a fresh process reads it
    head, emb = saved["weights"]["head"]["weight"], saved["weights"]["emb"]["embed.weight"]
    assert torch.equal(head, emb)  # one tensor, under each of its names
    case, opt, t = _gemma2_in_nodes()
    t.load(saved["weights"], strict=True)
    opt.load_state_dict(saved["optimizer"])
    t.steps = saved["steps"]
    assert first + t.fit(data[2:]).history == pytest.approx(expected, rel=16 * F32_EPS)
    model = case.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie still holds


def test_mambas_cache_is_refused_whole_and_segformers_pixels_come_back_bit_for_bit(tmp_path):
    store = Store(tmp_path)
    case = CASES["mamba"]()
    model = case.model.eval()  # in eval mode its output carries its conv and scan states
    g = Graph.somatize(Node.of(model).named("mamba").frozen().cached())
    freeze(g)
    with pytest.raises(NoCodec, match=r"node 'mamba'.*LinearAttentionLayer.*use_cache=False"):
        g.forward(case.example, store=store)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # nothing kept of it
    x = {**case.example, "use_cache": False}
    said: list = []
    out = g.forward(x, store=store, watching=said.append)
    again = g.forward(x, store=Store(tmp_path), watching=said.append)
    assert [f["cache"] for f in said if f["fact"] == "ran"] == ["miss", "hit"]
    with torch.no_grad():
        assert torch.equal(again.logits, model(**x).logits)
    assert torch.equal(again.logits, out.logits)

    seg = CASES["segformer"]()
    with torch.no_grad():
        pixels = seg.model.eval()(seg.example)
    store.keep("seg", pixels)
    back = Store(tmp_path).recall("seg")
    assert type(back) is type(pixels) and back.logits.shape == (2, 4, 8, 8)
    assert torch.equal(back.logits, pixels.logits) and back.logits.dtype == torch.float32


def test_two_gemma2_clients_meet_in_a_store_and_get_fedavg_of_what_they_learnt(tmp_path):
    trainers, cases = [], []
    for k in range(2):
        case = CASES["gemma2"]()
        g = Graph.somatize(case.model)
        t = Trainer(g, objective=case.objective, optimizer=torch.optim.SGD(parameters(g), lr=0.5))
        t.fit([(case.example, case.target)] * (k + 1))
        trainers.append(t)
        cases.append(case)
    exports = [t.export() for t in trainers]
    got: list = [None, None]

    def client(k):
        got[k] = gather(
            Store(tmp_path),
            exports[k],
            run="fed",
            round=0,
            clients=2,
            mine=k,
            size=k + 1,
            within=60,
            asking=0.05,
        )

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    (nid,) = exports[0]
    for key, first in exports[0][nid].items():  # FedAvg by samples, in float64, by hand
        want = (first.double() + 2 * exports[1][nid][key].double()) / 3
        assert torch.allclose(got[0][nid][key].double(), want, rtol=0, atol=4 * F32_EPS), key
        assert torch.equal(got[0][nid][key], got[1][nid][key])
    trainers[0].load(got[0], strict=True)
    model = cases[0].model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, got[0][nid]["lm_head.weight"])


def test_a_frozen_cached_dinov2_backbone_runs_once_and_its_head_trains_as_by_hand(tmp_path):
    case = CASES["dinov2"]()
    torch.manual_seed(3)
    head = nn.Linear(32, 5)
    ref_backbone, ref_head = copy.deepcopy(case.model.dinov2).eval(), copy.deepcopy(head)
    g = Graph.somatize(
        Node.of(case.model.dinov2).named("backbone").frozen().cached()
        >> Node.of(_last_hidden).named("last")
        >> Node.of(head).named("head")
    )
    said: list = []
    t = Trainer(
        g,
        objective=lambda logits, y: F.cross_entropy(logits[:, 0], y),
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        store=tmp_path,
        watching=said.append,
    )
    history = t.fit([(case.example, case.target)] * 3).history
    assert [f["cache"] for f in said if f["fact"] == "ran" and "cache" in f] == [
        "miss",
        "hit",
        "hit",
    ]
    opt = torch.optim.SGD(ref_head.parameters(), lr=0.1)
    with torch.no_grad():
        h = ref_backbone(case.example).last_hidden_state
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(ref_head(h)[:, 0], case.target)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert history == pytest.approx(expected, rel=16 * F32_EPS)
