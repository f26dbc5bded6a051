"""A transformers ModelOutput written down and read back: in a store, as a cached frozen
backbone's output, from a worker; and bytes that name anything else refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch
import transformers
from torch import nn
from transformers.cache_utils import DynamicCache

from somatize import Broker, Graph, Node, Store, Worker
from somatize.codecs import Malformed, NoCodec, decode, encode

KIND = "transformers.ModelOutput"  # what the codec writes an output as (`forged` checks it)
CACHE = "transformers.Cache"


def small_config(**more) -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=50,
        **more,
    )


def small_bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(small_config()).eval()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def same_output(a, b) -> bool:
    return (
        type(a) is type(b)
        and list(a.keys()) == list(b.keys())
        and all(torch.equal(a[k], b[k]) for k in a.keys())
    )


def test_an_output_is_kept_and_recalled_as_the_same_class_with_the_same_fields(tmp_path):
    with torch.no_grad():
        out = small_bert()(**batch())
    store = Store(tmp_path)
    store.keep("bert/out", out)
    back = store.recall("bert/out")
    assert same_output(back, out)
    assert back.last_hidden_state is back[0]  # a ModelOutput still: by field and by index


def test_a_cached_frozen_backbone_is_read_back_from_the_store_not_run_again(tmp_path):
    bert = small_bert()
    calls = []
    bert.register_forward_hook(lambda m, a, o: calls.append(1))
    g = Graph.somatize(
        Node.of(bert).frozen().cached()
        >> Node.of(lambda o: o.last_hidden_state[:, 0]).named("cls")
        >> Node.of(nn.Linear(32, 2)).named("head")
    )
    store = Store(tmp_path)
    first = g.forward(batch(), store=store)
    second = g.forward(batch(), store=store)
    assert len(calls) == 1  # the second forward read the backbone's output back
    assert torch.equal(first, second)


def forged(module: str, name: str, fields: list, kind: str = KIND) -> bytes:
    """The bytes of a kept ModelOutput (or a value of another `kind` written down here),
    naming whatever the writer chose."""
    from transformers.modeling_outputs import BaseModelOutput

    good = encode(BaseModelOutput(last_hidden_state=torch.zeros(1)))  # what the codec writes
    said, _ = msgpack.unpackb(msgpack.unpackb(good, raw=False).data, raw=False)
    assert said == KIND
    payload = encode([module, name, fields])
    envelope = msgpack.packb([kind, payload], use_bin_type=True)
    return msgpack.packb(msgpack.ExtType(3, envelope), use_bin_type=True)


@pytest.mark.parametrize(
    ("module", "name", "why"),
    [
        ("os", "system", "not a transformers output"),
        ("transformers.modeling_utils", "PreTrainedModel", "not a ModelOutput class"),
        ("transformers.models.bert.modeling_bert", "BertModel", "not a ModelOutput class"),
        ("transformers.not_a_module", "Output", "not a ModelOutput class"),
        ("transformers.modeling_outputs", "os.system", "not a transformers output"),
    ],
)
def test_bytes_naming_anything_but_an_imported_output_class_are_refused(module, name, why):
    with pytest.raises(Malformed, match=why):
        decode(forged(module, name, [["last_hidden_state", torch.zeros(1)]]))


def test_bytes_with_fields_the_class_does_not_have_are_refused():
    with pytest.raises(Malformed, match="could not be built from its fields"):
        decode(forged("transformers.modeling_outputs", "BaseModelOutput", [["nope", 1]]))


def test_the_codec_is_there_whichever_of_transformers_and_somatize_came_first(tmp_path):
    code = textwrap.dedent(
        f"""
        import torch
        from somatize import Store
        import somatize.torch
        from transformers.modeling_outputs import BaseModelOutput
        store = Store({str(tmp_path)!r})
        store.keep("out", BaseModelOutput(last_hidden_state=torch.ones(2, 3)))
        back = store.recall("out")
        assert type(back) is BaseModelOutput and torch.equal(back[0], torch.ones(2, 3))
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_a_backbone_on_a_worker_answers_its_output_as_it_is():
    bert = small_bert()
    with torch.no_grad():
        here = bert(**batch())
    broker = Broker.embedded({"gpu": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g = Graph.somatize(Node.of(bert).named("bert").at("gpu"))
        there = g.forward(batch(), broker=broker)
    finally:
        broker.close()
    assert type(there) is type(here) and list(there.keys()) == list(here.keys())
    width = here.last_hidden_state.shape[-1]  # the widest sum inside: a row of a linear layer
    tol = 4 * width * torch.finfo(torch.float32).eps
    for k in here.keys():
        assert torch.allclose(there[k], here[k], rtol=tol, atol=tol)


def test_a_codec_the_user_registered_for_outputs_wins():
    code = textwrap.dedent(
        """
        import torch
        import somatize
        from transformers.utils import ModelOutput
        from transformers.modeling_outputs import BaseModelOutput
        somatize.codec("mine", ModelOutput, dump=lambda v: b"mine", load=lambda b: "theirs")
        import somatize.torch
        from somatize.codecs import decode, encode
        assert decode(encode(BaseModelOutput(last_hidden_state=torch.ones(1)))) == "theirs"
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_a_backbone_trained_where_it_runs_hands_its_output_on_as_it_is():
    import torch.nn.functional as F

    from somatize.torch import Split, Trainer, parameters

    bert = small_bert().train()
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    seen = []

    def first_token(out):
        seen.append(type(out))
        return out.last_hidden_state[:, 0]

    x, y = batch(), torch.tensor([0, 1])
    broker = Broker.embedded({"gpu": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g = Graph.somatize(
            Node.of(bert).named("body").at("gpu")
            >> Node.of(first_token).named("cls")
            >> Node.of(nn.Linear(32, 2)).named("head")
        )
        trains = {"body": Split(torch.optim.SGD, lr=0.1)}
        opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
        t = Trainer(g, objective=F.cross_entropy, trains=trains, broker=broker, optimizer=opt)
        result = t.fit([(x, y)] * 4)
        trained = t.export()["body"]
    finally:
        broker.close()
    assert set(seen) == {transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions}
    assert result.history[-1] < result.history[0]
    moved = [k for k in before if not torch.equal(trained[k], before[k])]
    assert "encoder.layer.0.attention.self.query.weight" in moved  # trained there
    here = bert.state_dict()  # export brings the copy here up to what the worker learnt
    assert all(torch.equal(here[k], v) for k, v in trained.items())


def test_on_the_wire_an_output_keeps_its_tensors_requires_grad_and_forged_names_are_refused():
    from transformers.modeling_outputs import BaseModelOutput

    from somatize.remote import wire

    h = torch.randn(2, 3, requires_grad=True) * 2  # not a leaf, asks for a gradient
    back = wire.decode(wire.encode({"out": BaseModelOutput(last_hidden_state=h)}))["out"]
    assert type(back) is BaseModelOutput
    assert back.last_hidden_state.requires_grad and torch.equal(back[0], h.detach())

    header = msgpack.packb(
        msgpack.ExtType(6, msgpack.packb(["os", "system", []], use_bin_type=True)),
        use_bin_type=True,
    )
    with pytest.raises(wire.Malformed, match="not a transformers output"):
        wire.decode([header])


def test_a_tokenizers_batch_encoding_is_cut_into_micro_batches_as_itself():
    import torch.nn.functional as F

    from somatize.torch import Trainer, parameters

    config = small_config(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(2))
    x = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    y = torch.tensor([0, 1, 0, 1])
    seen = []

    def objective(out, target):
        return F.cross_entropy(out.logits, target)

    histories = []
    for micro in (1, 2):
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        model.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        g = Graph.somatize(model)
        opt = torch.optim.SGD(parameters(g), lr=0.1)
        histories.append(
            Trainer(g, objective=objective, optimizer=opt, micro=micro).fit([(x, y)] * 3).history
        )
    assert seen == [4, 4, 4] + [2] * 6  # the pieces reached the model as keywords, halved
    tol = 16 * config.hidden_size * torch.finfo(torch.float32).eps
    assert histories[1] == pytest.approx(histories[0], rel=tol)


def test_a_model_that_computes_its_own_loss_trains_on_batch_none_and_a_bare_dict_says_so():
    from somatize.torch import Trainer, parameters

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=1,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    g = Graph.somatize(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    t = Trainer(
        g, objective=lambda out, _: out.loss, optimizer=torch.optim.SGD(parameters(g), lr=0.5)
    )
    with pytest.raises(TypeError, match=r"\(batch, None\), with objective=lambda out, _: out.loss"):
        t.step({"input_ids": ids, "labels": ids})
    with pytest.raises(TypeError, match=r"not a BatchEncoding of input_ids, labels: yield pairs"):
        t.step(transformers.BatchEncoding({"input_ids": ids, "labels": ids}))  # a collator's
    with pytest.raises(TypeError, match=r"not a tensor of shape \(2, 8\): yield pairs"):
        t.step(ids)
    result = t.fit([({"input_ids": ids, "labels": ids}, None)] * 3)
    assert result.history[-1] < result.history[0]


def test_a_process_without_transformers_loaded_refuses_an_output_and_imports_nothing():
    code = textwrap.dedent(
        """
        import sys
        import msgpack
        import torch
        import somatize.torch
        from somatize.remote import wire
        fields = ["transformers.modeling_outputs", "BaseModelOutput", []]
        header = msgpack.packb(msgpack.ExtType(6, msgpack.packb(fields)), use_bin_type=True)
        try:
            wire.decode([header])
        except wire.Malformed as error:
            assert "has not loaded transformers" in str(error), error
        else:
            raise SystemExit("a ModelOutput was built without transformers")
        assert "transformers" not in sys.modules
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def cache(*layers) -> DynamicCache:
    return DynamicCache([(torch.randn(*shape), torch.randn(*shape)) for shape in layers])


def test_a_kept_cache_comes_back_as_itself_and_one_no_constructor_rebuilds_is_refused(tmp_path):
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    store = Store(tmp_path)
    kept = EncoderDecoderCache(cache((2, 2, 5, 8), (2, 2, 5, 8)), cache((2, 2, 3, 8)))
    store.keep("cache", kept)
    back = store.recall("cache")
    assert type(back) is EncoderDecoderCache and type(back.cross_attention_cache) is DynamicCache
    assert back.get_seq_length() == 5 and back.is_updated == kept.is_updated
    for a, b in zip(back, kept, strict=True):
        assert all(x is y is None or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    static = StaticCache(config=small_config(), max_cache_len=8)
    with pytest.raises(NoCodec, match=r"StaticCache .* Pass use_cache=False"):
        store.keep("static", static)


DYNAMIC = ("transformers.cache_utils", "DynamicCache")


@pytest.mark.parametrize(
    ("kind", "module", "name", "fields", "why"),
    [
        (CACHE, *DYNAMIC, [["layers", [[torch.zeros(2, 3)] * 2]], ["lazy", False]], "not two"),
        (
            CACHE,
            *DYNAMIC,
            [["layers", [[torch.zeros(1, 1, 1, 1), "x"]]], ["lazy", False]],
            "not tensors",
        ),
        (CACHE, *DYNAMIC, [["layers", []], ["lazy", 1]], r"\['lazy', bool\]"),
        (CACHE, *DYNAMIC, [["layers", [[None, None]]], ["lazy", True]], "is empty"),
        (CACHE, "transformers.cache_utils", "StaticCache", [], "not a ModelOutput class"),
        (
            CACHE,
            "transformers.cache_utils",
            "EncoderDecoderCache",
            [["self_attention_cache", 1], ["cross_attention_cache", 2]],
            "not dynamic",
        ),
        (KIND, *DYNAMIC, [["layers", []], ["lazy", False]], "not a transformers.ModelOutput"),
        (CACHE, "transformers.modeling_outputs", "BaseModelOutput", [], "not a transformers.Cache"),
        (
            "transformers.BatchEncoding",
            *DYNAMIC,
            [["layers", []], ["lazy", False]],
            "not a transformers.BatchEncoding",
        ),
    ],
)
def test_kept_cache_bytes_that_do_not_hold_a_cache_are_refused(kind, module, name, fields, why):
    with pytest.raises(Malformed, match=why):
        decode(forged(module, name, fields, kind))


def tokenized() -> transformers.BatchEncoding:
    return transformers.BatchEncoding(batch())  # what a tokenizer hands back


def test_a_tokenizers_batch_encoding_is_kept_and_keys_a_cached_backbone(tmp_path):
    store = Store(tmp_path)
    store.keep("batch", tokenized())
    back = store.recall("batch")
    assert type(back) is transformers.BatchEncoding and list(back) == list(batch())
    assert torch.equal(back.input_ids, batch()["input_ids"])  # by attribute, as a batch is read
    pixels = torch.randn(2, 3, 4, 4)
    store.keep("features", transformers.BatchFeature({"pixel_values": pixels}))
    back = store.recall("features")  # what an image processor hands back
    assert type(back) is transformers.BatchFeature and torch.equal(back.pixel_values, pixels)

    bert = small_bert()
    calls = []
    bert.register_forward_hook(lambda m, a, o: calls.append(1))
    g = Graph.somatize(Node.of(bert).named("bert").frozen().cached())
    first = g.forward(tokenized(), store=store)
    second = g.forward(tokenized(), store=Store(tmp_path))
    assert len(calls) == 1 and same_output(first, second)


def class_name(value) -> str:
    """What a worker was handed, said by its class."""
    return type(value).__name__


def test_a_tokenizers_batch_encoding_crosses_to_a_worker_as_itself():
    bert = small_bert()
    with torch.no_grad():
        here = bert(**batch())
    broker = Broker.embedded({"gpu": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g = Graph.somatize(Node.of(bert).named("bert").at("gpu"))
        there = g.forward(tokenized(), broker=broker)
        seen = Graph.somatize(Node.of(class_name).at("gpu")).forward(tokenized(), broker=broker)
    finally:
        broker.close()
    tol = 4 * here.last_hidden_state.shape[-1] * torch.finfo(torch.float32).eps
    assert torch.allclose(there.last_hidden_state, here.last_hidden_state, rtol=tol, atol=tol)
    assert seen == "BatchEncoding"
