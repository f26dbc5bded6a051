"""The families of tests/models/more.py kept, cached and trained on a worker, as a researcher
would: a frozen Whisper encoder cached while its decoder trains (against the same training
uncached), a Llama's output with its key-value cache kept and decoding going on from the
recalled cache, a sliding-window cache refused whole, and whole models (wav2vec2, whose
positional convolution is weight-normed, and Llama) trained on a real worker process by
`Split` against the same training in one process (float64)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models.more import CASES
from models.zoo import cache_name, cache_of
from torch import nn

import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Broker, Graph, Node, Store, Worker
from somatize.codecs import NoCodec
from somatize.torch import Split, Trainer, freeze, parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")


def _still(model: nn.Module) -> nn.Module:
    """`model` in float64 with every dropout (modules, the rates transformers keeps as
    attributes, a layer drop its config says) at 0, so a run is the same whatever the random
    stream."""
    model = model.double()
    model.config.layerdrop = 0.0  # wav2vec2 reads it at each forward
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("dropout", "activation_dropout", "attention_dropout", "layerdrop"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


def _token_loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class Encoder(nn.Module):
    """Whisper's encoder on the spectrogram (the decoder's tokens pass it by)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_features, decoder_input_ids=None):
        return self.encoder(input_features)


class Tokens(nn.Module):
    """The decoder's tokens out of the batch."""

    def forward(self, input_features=None, decoder_input_ids=None):
        return decoder_input_ids


class Decoder(nn.Module):
    """Whisper's decoder and head, on the encoder's output (a `BaseModelOutput`) and tokens
    (its predecessors' ids name them)."""

    def __init__(self, model):
        super().__init__()
        self.decoder, self.head = model.model.decoder, model.proj_out

    def forward(self, enc, ids):
        h = self.decoder(input_ids=ids, encoder_hidden_states=enc.last_hidden_state)
        return self.head(h.last_hidden_state)


def _whisper_batches(case, seed: int) -> list:
    """Three float64 batches for the suite's Whisper: spectrograms drawn from `seed`, the
    example's decoder tokens and target rolled by 0, 1 and 2."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            {
                "input_features": torch.randn(2, 8, 32, generator=gen, dtype=torch.float64),
                "decoder_input_ids": case.example["decoder_input_ids"].roll(i, 1),
            },
            case.target.roll(i, 1),
        )
        for i in range(3)
    ]


def test_a_cached_frozen_whisper_encoder_trains_its_decoder_as_the_uncached_run(tmp_path):
    case = CASES["whisper"]()
    model = _still(case.model)
    batches = _whisper_batches(case, 5)

    def run(store):
        m = copy.deepcopy(model)
        g = Graph.somatize(
            (
                Node.of(Encoder(m.model.encoder)).named("enc").frozen().cached()
                | Node.of(Tokens()).named("ids")
            )
            >> Node.of(Decoder(m)).named("dec")
        )
        freeze(g)
        said = []
        opt = torch.optim.Adam(parameters(g, without=["enc"]), lr=1e-2)
        t = Trainer(g, objective=_token_loss, optimizer=opt, store=store, watching=said.append)
        losses = t.fit(batches, epochs=2).history
        caching = [f.get("cache") for f in said if f["fact"] == "ran" and f["node"] == "enc"]
        return losses, t.export(), caching

    cached, cached_weights, caching = run(Store(tmp_path / "store"))
    plain, plain_weights, _ = run(None)
    assert caching == ["miss"] * 3 + ["hit"] * 3  # each batch's encoding computed once
    assert cached == plain  # the recalled encodings are the computed ones, bit for bit
    for key, want in plain_weights["dec"].items():
        assert torch.equal(cached_weights["dec"][key], want), key
    assert cached[-1] < cached[0]


def test_a_llamas_output_and_its_cache_are_recalled_and_decoding_goes_on_from_them(tmp_path):
    store = Store(tmp_path / "store")
    case = CASES["llama"]()
    model = case.model.eval()
    with torch.no_grad():
        out = model(**case.example, labels=case.target)  # a 0-d loss, logits, a DynamicCache
        half = copy.deepcopy(model).bfloat16()(**case.example, output_hidden_states=True)
    store.keep("llama", out)
    store.keep("bf16", half)
    back, half_back = store.recall("llama"), store.recall("bf16")
    assert type(back) is type(out) and list(back.keys()) == list(out.keys())
    assert back.loss.shape == () and torch.equal(back.loss, out.loss)
    assert torch.equal(back.logits, out.logits)
    assert half_back.logits.dtype == torch.bfloat16 and torch.equal(half_back.logits, half.logits)
    assert type(half_back.hidden_states) is tuple
    assert all(map(torch.equal, half_back.hidden_states, half.hidden_states))
    cache = cache_of(back)
    assert type(cache) is type(cache_of(out))
    assert cache.get_seq_length() == cache_of(out).get_seq_length() == 8
    step = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        want = model(input_ids=step, **{cache_name(out): copy.deepcopy(cache_of(out))}).logits
        got = model(input_ids=step, **{cache_name(out): cache}).logits
    assert torch.equal(got, want)


def test_a_sliding_window_cache_is_refused_naming_it_and_nothing_is_kept(tmp_path):
    store = Store(tmp_path / "store")
    model = CASES["qwen2"](window=4).model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, 96, (2, 8)))
    with pytest.raises(NoCodec, match="DynamicSlidingWindowLayer.*use_cache=False"):
        store.keep("qwen2", out)
    assert store.resolve("qwen2") is None and store.bound() == []


def _split_against_one_process(case, make_batches):
    """`case`'s whole model on a worker (as code), trained by Split(SGD) with the loss it
    computes from the labels, against the same steps in plain torch here: both loss lists and
    the largest difference of the worker's weights, and of the copy here (brought up to them by
    `export`) run again, from the plain run's."""
    model = _still(case.model)
    batches = make_batches(case)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, _ in batches:
        opt.zero_grad()
        loss = ref(**x).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    broker = Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g = Graph.somatize(Node.of(model).named("model").at("w"))
        trains = {"model": Split(torch.optim.SGD, lr=0.1)}
        t = Trainer(g, objective=lambda out, y: out.loss, trains=trains, broker=broker)
        got = [t.step(batch) for batch in batches]
        learnt = t.export()["model"]
    finally:
        broker.close()
    assert learnt.keys() == ref.state_dict().keys()
    far = max((learnt[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    with torch.no_grad():  # the copy here, brought up to what the worker learnt, still runs
        here, there = model(**batches[0][0]).logits, ref(**batches[0][0]).logits
    far = max(far, (here - there).abs().max().item())
    return got, want, far


def test_a_wav2vec2_with_its_weight_normed_convolution_trains_on_a_worker_as_in_one_process():
    def batches(case):
        gen = torch.Generator().manual_seed(6)
        return [
            (
                {
                    "input_values": torch.randn(2, 400, generator=gen, dtype=torch.float64),
                    "labels": case.target.roll(i),
                },
                case.target,
            )
            for i in range(3)
        ]

    case = CASES["wav2vec2"]()
    conv = case.model.wav2vec2.encoder.pos_conv_embed.conv
    assert torch.nn.utils.parametrize.is_parametrized(conv)  # a module torch will not pickle
    conv.requires_grad_(False)  # and set aside: it must stay so on the worker
    got, want, far = _split_against_one_process(case, batches)
    assert got == pytest.approx(want, rel=1e-12)
    assert far < 1e-12


def test_a_whole_llama_returning_its_cache_trains_on_a_worker_as_in_one_process():
    def batches(case):
        ids = case.example["input_ids"]
        return [
            ({"input_ids": ids.roll(i, 1), "labels": ids.roll(i - 1, 1)}, ids) for i in range(3)
        ]

    got, want, far = _split_against_one_process(CASES["llama"](), batches)
    assert got == pytest.approx(want, rel=1e-6)  # its loss is taken in float32
    assert far < 1e-6


UNREADABLE = [
    getattr(torch, name)
    for name in ("float4_e2m1fn_x2", "float8_e8m0fnu", "complex32")
    if hasattr(torch, name)
]
"""Dtypes safetensors writes, or not, but does not read back (MX formats' scales and packed
fp4, a half complex): a quantized model's weights and scales hold them."""


@pytest.mark.parametrize("dtype", UNREADABLE, ids=str)
def test_a_tensor_of_a_dtype_that_cannot_be_read_back_is_refused_when_kept(tmp_path, dtype):
    store = Store(tmp_path / "store")
    tensor = torch.zeros(4, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else None
    tensor = torch.zeros(4, dtype=dtype) if tensor is None else tensor
    with pytest.raises(TypeError, match=rf"{dtype}.*cannot be written down.*\.to\("):
        store.keep("scales", {"w": torch.ones(2), "scales": tensor})
    assert store.resolve("scales") is None and store.bound() == []


def test_a_nested_tensor_is_refused_saying_to_unbind_it(tmp_path):
    store = Store(tmp_path / "store")
    clips = [torch.ones(2, 3), torch.ones(5, 3)]  # audio clips of two lengths
    for layout in (torch.strided, torch.jagged):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
            nested = torch.nested.nested_tensor(clips, layout=layout)
        with pytest.raises(TypeError, match=r"nested tensor cannot be written down.*unbind"):
            store.keep("clips", nested)
    assert store.bound() == []
    store.keep("clips", list(nested.unbind()))
    assert all(map(torch.equal, store.recall("clips"), clips))


def test_a_models_cache_that_cannot_come_back_from_a_worker_is_said_naming_the_node():
    model = CASES["qwen2"](window=4).model
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    broker = Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g = Graph.somatize(Node.of(model).named("lm").at("w"))
        trains = {"lm": Split(torch.optim.SGD, lr=0.1)}
        t = Trainer(g, objective=lambda out, y: out.loss, trains=trains, broker=broker)
        said = r"output of node 'lm'.*DynamicSlidingWindowLayer.*use_cache=False"
        with pytest.raises(NoCodec, match=said):
            t.step(({"input_ids": ids, "labels": ids}, ids))
        with pytest.raises(NoCodec, match=said), torch.no_grad():
            g.forward({"input_ids": ids}, broker=broker)
        # told what to do, the user does it, and the step goes on
        loss = t.step(({"input_ids": ids, "labels": ids, "use_cache": False}, ids))
        with torch.no_grad():
            want = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
        assert loss == pytest.approx(want, rel=1e-5)  # float32, one forward each side
        t.export()
    finally:
        broker.close()


def test_a_whisper_decoder_on_a_worker_is_handed_the_encoders_output_and_trains_as_in_one_process():
    case = CASES["whisper"]()
    model = _still(case.model)
    ref = copy.deepcopy(model)
    batches = _whisper_batches(case, 7)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, y in batches:
        opt.zero_grad()
        loss = _token_loss(ref(**x).logits, y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    # a fresh worker, which has not loaded transformers: the encoder's BaseModelOutput is the
    # first of transformers' values it reads
    broker = Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g = Graph.somatize(
            (Node.of(Encoder(model.model.encoder)).named("enc") | Node.of(Tokens()).named("ids"))
            >> Node.of(Decoder(model)).named("dec").at("w")
        )
        trains = {"dec": Split(torch.optim.SGD, lr=0.1)}
        opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
        t = Trainer(g, objective=_token_loss, optimizer=opt, trains=trains, broker=broker)
        got = [t.step(batch) for batch in batches]
        learnt = t.export()["dec"]
        with torch.no_grad():
            there = g.forward(batches[0][0], broker=broker)
    finally:
        broker.close()
    assert got == pytest.approx(want, rel=1e-12)
    for key, v in ref.model.decoder.state_dict().items():
        torch.testing.assert_close(learnt[f"decoder.{key}"], v, rtol=0, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(there, ref(**batches[0][0]).logits, rtol=0, atol=1e-12)


class Embeddings(nn.Module):
    """DistilBERT's embeddings (they stay with each client's data)."""

    def __init__(self, model):
        super().__init__()
        self.embeddings = model.distilbert.embeddings

    def forward(self, input_ids, attention_mask=None):
        return self.embeddings(input_ids)


class Layers(nn.Module):
    """DistilBERT's transformer layers (on each client's worker)."""

    def __init__(self, model):
        super().__init__()
        self.transformer = model.distilbert.transformer

    def forward(self, h):
        return self.transformer(h, attn_mask=None)[0]


class Classifier(nn.Module):
    """DistilBERT's head on its first token."""

    def __init__(self, model):
        super().__init__()
        self.pre, self.out = model.pre_classifier, model.classifier

    def forward(self, h):
        return self.out(torch.relu(self.pre(h[:, 0])))


def _both(work):
    """`work(0)` and `work(1)` at once, in two threads, waited for."""
    import threading

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def test_federated_averaging_of_distilberts_trained_on_two_workers_is_the_average_by_hand(
    tmp_path,
):
    from somatize.torch import gather

    case = CASES["distilbert"]()
    base, ids = _still(case.model), case.example["input_ids"]
    store, sizes = Store(tmp_path / "store"), [3, 1]
    brokers, trainers, failed = [None, None], [None, None], []

    def train(k):  # each client its own worker, its own copy and its own data, at once
        try:
            brokers[k] = Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")})
            m = copy.deepcopy(base)
            g = Graph.somatize(
                Node.of(Embeddings(m)).named("emb")
                >> Node.of(Layers(m)).named("layers").at("w")
                >> Node.of(Classifier(m)).named("head")
            )
            trains = {"layers": Split(torch.optim.SGD, lr=0.1)}
            opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
            t = Trainer(g, objective=nn.functional.cross_entropy, optimizer=opt, trains=trains,
                        broker=brokers[k])  # fmt: skip
            t.step(({"input_ids": ids.roll(k, 1)}, case.target.roll(k)))
            trainers[k] = t
        except Exception as error:  # noqa: BLE001  (asserted below)
            failed.append(error)

    try:
        _both(train)
        assert not failed, failed
        exports = [t.export() for t in trainers]
        got = {}

        def client(k):
            try:
                got[k] = gather(store, exports[k], run="fed", round=0, clients=2, mine=k,
                                size=sizes[k], within=30, asking=0.02)  # fmt: skip
            except Exception as error:  # noqa: BLE001  (asserted below)
                failed.append(error)

        _both(client)
        assert not failed, failed
        assert exports[0]["layers"].keys() == {
            f"transformer.{k}" for k in base.distilbert.transformer.state_dict()
        }
        for nid, state in exports[0].items():
            for key in state:
                by_hand = (exports[0][nid][key] * 3 + exports[1][nid][key]) / 4  # float64
                for k in range(2):
                    torch.testing.assert_close(got[k][nid][key], by_hand, rtol=0, atol=1e-15)
        assert not torch.equal(exports[0]["layers"]["transformer.layer.0.ffn.lin1.weight"],
                               exports[1]["layers"]["transformer.layer.0.ffn.lin1.weight"])  # fmt: skip
        for t in trainers:  # each goes on from the average, its worker's copy too
            t.load(got[0])
            for nid, state in t.export().items():
                for key, v in state.items():
                    assert torch.equal(v, got[0][nid][key]), (nid, key)
    finally:
        for broker in brokers:
            if broker is not None:
                broker.close()


class Devices(Node):
    """Where the logits and the key/value cache it is handed are."""

    def forward(self, out, ctx):
        layer = cache_of(out).layers[0]
        return str(out.logits.device), str(layer.keys.device), str(layer.values.device)


def test_a_models_cache_arriving_at_a_node_on_a_device_is_moved_there_with_the_rest(tmp_path):
    case = CASES["llama"]()
    model = case.model.eval()
    g = Graph.somatize(Node.of(model).named("lm").frozen().cached() >> Devices().on("meta"))
    freeze(g)
    store = Store(tmp_path / "store")
    with torch.no_grad():
        assert g.forward(case.example) == ("meta",) * 3
        g.forward(case.example, store=store)
        assert g.forward(case.example, store=store) == ("meta",) * 3  # recalled on the cpu


class SwinBody(nn.Module):
    """Swin's patch embeddings and encoder: its own `SwinEncoderOutput`."""

    def __init__(self, swin):
        super().__init__()
        self.embeddings, self.encoder = swin.embeddings, swin.encoder

    def forward(self, pixels):
        h, dims = self.embeddings(pixels)
        return self.encoder(h, dims)


class SwinHead(nn.Module):
    """A head of plain torch modules on what Swin's encoder gives (nothing of transformers)."""

    def __init__(self, model):
        super().__init__()
        self.norm, self.out = model.swin.layernorm, model.classifier

    def forward(self, encoded):
        return self.out(self.norm(encoded.last_hidden_state).mean(1))


def test_a_worker_handed_a_models_own_output_says_how_to_start_it_and_then_reads_it():
    from somatize.codecs import Malformed

    case = CASES["swin"]()
    model = case.model.eval()
    g = Graph.somatize(
        Node.of(SwinBody(model.swin)).named("body")
        >> Node.of(SwinHead(model)).named("head").at("w")
    )
    with torch.no_grad():
        want = model(case.example).logits
    module = "transformers.models.swin.modeling_swin"
    for argv, fails in (
        (["--threads", "1"], True),
        (["--threads", "1", "--import", module], False),
    ):
        with Broker.embedded({"w": Worker.spawn(argv, mode="network")}) as broker, torch.no_grad():
            if fails:
                with pytest.raises(Malformed, match=rf"start the worker with --import {module}"):
                    g.forward(case.example, broker=broker)
            else:
                torch.testing.assert_close(g.forward(case.example, broker=broker), want)
