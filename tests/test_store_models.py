"""Real models kept in a real store, as a researcher would: a `Node.of(model)` cached (GPT-2,
an LSTM and a GRU, a compiled net), its output recalled bit for bit in a fresh process, its
key the same in every process and changed by what changes what it computes (train or eval
mode, a load_state_dict), a damaged value computed again, a mapped model run on the missing
items alone, a state_dict kept and loaded, an output class of one's own refused when kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from models import zoo

import somatize
import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Graph, Node, Store
from somatize.torch import freeze

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")


def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    """The suite's GPT-2 (tests/models/zoo.py) at random init, and its token ids."""
    case = zoo.gpt2()
    return case.model, case.example["input_ids"]


def _caching(g: Graph, x, store: Store):
    said: list = []
    out = g.forward(x, store=store, watching=said.append)
    return out, [f.get("cache") for f in said if f["fact"] == "ran"]


def test_a_generative_models_cached_output_is_found_by_another_process(tmp_path: Path) -> None:
    # a generative model holds a GenerationConfig, which keeps a hash() of its process:
    # a key that read it would differ in every process, and no cached value would be found
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys

            import torch
            from models import zoo

            from somatize import Graph, Node, Store
            from somatize.torch import freeze

            case = zoo.gpt2()
            g = Graph.somatize(Node.of(case.model).frozen().cached())
            freeze(g)
            said = []
            ids = case.example["input_ids"]
            out = g.forward({"input_ids": ids}, store=Store(sys.argv[1]), watching=said.append)
            torch.save(out.logits, sys.argv[2])
            print([f.get("cache") for f in said if f["fact"] == "ran"])
            """
        )
    )
    answers = []
    for seed in ("1", "2"):
        ran = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "store"), str(tmp_path / f"{seed}.pt")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)},
            timeout=240,
        )
        assert ran.returncode == 0, ran.stderr
        answers.append(ran.stdout.strip())
    assert answers == ["['miss']", "['hit']"]
    first, second = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert first.dtype == second.dtype == torch.float32
    assert torch.equal(first, second)  # recalled bit for bit


def test_train_and_eval_mode_keep_different_values(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()  # dropout 0.1 in its config: train mode draws a mask
    g = Graph.somatize(Node.of(model).frozen().cached())
    freeze(g)  # eval mode
    with torch.no_grad():
        want = model(input_ids=ids).logits
    evaluated, said = _caching(g, {"input_ids": ids}, store)
    assert said == ["miss"] and torch.equal(evaluated.logits, want)
    assert _caching(g, {"input_ids": ids}, store)[1] == ["hit"]
    model.train()
    trained, said = _caching(g, {"input_ids": ids}, store)
    assert said == ["miss"]  # not the eval value handed back
    assert not torch.equal(trained.logits, want)
    model.eval()
    again, said = _caching(g, {"input_ids": ids}, store)
    assert said == ["hit"] and torch.equal(again.logits, want)
    model.transformer.drop.train()  # one module's mode is enough to miss
    assert _caching(g, {"input_ids": ids}, store)[1] == ["miss"]


def test_a_models_output_kept_here_is_recalled_whole_by_a_process_that_imported_nothing(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids)  # CausalLMOutputWithCrossAttentions holding a DynamicCache
    store.keep("gpt2", out)
    store.keep("mixed", {"half": out.logits.half(), "bf16": out.logits.bfloat16()[:, ::2]})
    script = textwrap.dedent(
        """
        import sys
        from somatize import Store

        store = Store(sys.argv[1])
        out, mixed = store.recall("gpt2"), store.recall("mixed")
        import torch

        layers = [[layer.keys, layer.values] for layer in out.past_key_values.layers]
        torch.save([type(out).__name__, type(out.past_key_values).__name__, out.logits,
                    layers, mixed], sys.argv[2])
        """
    )
    ran = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store"), str(tmp_path / "got.pt")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ran.returncode == 0, ran.stderr
    kind, cache, logits, layers, mixed = torch.load(tmp_path / "got.pt", weights_only=False)
    assert (kind, cache) == ("CausalLMOutputWithCrossAttentions", "DynamicCache")
    assert torch.equal(logits, out.logits)
    kept = [[layer.keys, layer.values] for layer in out.past_key_values.layers]
    assert len(layers) == len(kept) == 2
    for (k, v), (k0, v0) in zip(layers, kept, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert mixed["half"].dtype == torch.float16 and mixed["bf16"].dtype == torch.bfloat16
    assert torch.equal(mixed["half"], out.logits.half())
    assert torch.equal(mixed["bf16"], out.logits.bfloat16()[:, ::2])


def test_loading_weights_into_a_frozen_cached_model_misses_and_computes_anew(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()
    g = Graph.somatize(Node.of(model).frozen().cached())
    freeze(g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert _caching(g, {"input_ids": ids}, store)[1] == ["miss"]
    assert _caching(g, {"input_ids": ids}, store)[1] == ["hit"]
    changed = {k: v + 0.01 if v.is_floating_point() else v for k, v in before.items()}
    model.load_state_dict(changed)  # a new checkpoint into the same backbone
    out, said = _caching(g, {"input_ids": ids}, store)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert said == ["miss"] and torch.equal(out.logits, want)
    model.transformer.h[0].load_state_dict(  # a submodule's load reaches the key too
        {k[len("transformer.h.0.") :]: v for k, v in before.items() if ".h.0." in k}
    )
    assert _caching(g, {"input_ids": ids}, store)[1] == ["miss"]
    model.load_state_dict(before)  # the first weights again: what they made is found
    out, said = _caching(g, {"input_ids": ids}, store)
    with torch.no_grad():
        assert said == ["hit"] and torch.equal(out.logits, model(input_ids=ids).logits)
    with torch.no_grad():  # changed in place by hand: the graph is told with invalidate()
        model.lm_head.weight[0, 0] += 1.0
    g.invalidate()
    out, said = _caching(g, {"input_ids": ids}, store)
    with torch.no_grad():
        assert said == ["miss"] and torch.equal(out.logits, model(input_ids=ids).logits)


def test_a_damaged_cached_output_is_computed_again_and_the_store_repaired(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()
    g = Graph.somatize(Node.of(model).frozen().cached())
    freeze(g)
    first, _ = _caching(g, {"input_ids": ids}, store)
    (kept,) = store.bound("cache")
    hexed = kept.digest.split(":")[1]
    blob = tmp_path / "store" / "blobs" / "sha256" / hexed[:2] / hexed[2:]
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 1  # one bit flipped on disk
    blob.write_bytes(bytes(damaged))
    with pytest.warns(RuntimeWarning, match=r"node 'gpt2lmheadmodel'.*corrupt.*computed again"):
        again, said = _caching(g, {"input_ids": ids}, store)
    assert said == ["miss"] and torch.equal(again.logits, first.logits)
    assert store.get(kept.digest) is not None  # the blob was put again, whole
    out, said = _caching(g, {"input_ids": ids}, store)
    assert said == ["hit"] and torch.equal(out.logits, first.logits)


@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU])
def test_a_torch_rnn_is_cached_and_its_nested_tuple_output_comes_back_as_it_was(
    tmp_path: Path, kind: type
) -> None:
    # an RNN holds weak references to its weights (_flat_weight_refs): keyed by what they
    # point at, not refused as state a key cannot read
    store = Store(tmp_path / "store")
    torch.manual_seed(0)
    rnn = kind(4, 6, batch_first=True)
    g = Graph.somatize(Node.of(rnn).frozen().cached())
    freeze(g)
    x = torch.randn(2, 5, 4, dtype=torch.float32)
    first, said = _caching(g, x, store)
    assert said == ["miss"]
    again, said = _caching(g, x, store)
    assert said == ["hit"]
    assert type(again) is tuple and len(again) == 2
    assert type(again[1]) is type(first[1])  # (h, c) stays a tuple, a GRU's h a tensor
    with torch.no_grad():
        want = rnn(x)
    assert torch.equal(again[0], want[0])
    if kind is torch.nn.LSTM:
        assert all(torch.equal(a, b) for a, b in zip(again[1], want[1], strict=True))
    else:
        assert torch.equal(again[1], want[1])


def test_a_mapped_cached_model_is_called_on_each_missing_item_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()
    handed: list = []
    model.register_forward_hook(
        lambda m, args, kwargs, out: handed.append(kwargs), with_kwargs=True
    )
    g = Graph.somatize(Node.of(model).frozen().cached().mapped())
    freeze(g)
    items = [{"input_ids": ids[:1]}, {"input_ids": ids[1:]}]
    first, said = _caching(g, items, store)
    assert said == ["miss"] and len(first) == 2 and len(handed) == 2
    more = [*items, {"input_ids": ids[:1, :4]}]
    out, said = _caching(g, more, store)
    assert said == ["partial"] and len(handed) == 3  # the new item alone
    assert torch.equal(handed[-1]["input_ids"], ids[:1, :4])
    with torch.no_grad():
        for got, item in zip(out, more, strict=True):
            assert torch.equal(got.logits, model(**item).logits)


def test_a_frozen_node_not_settled_is_warned_about_when_cached(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()  # random init: train mode, every parameter asking for a gradient
    g = Graph.somatize(Node.of(model).frozen().cached())
    with pytest.warns(UserWarning, match=r"'gpt2lmheadmodel' is declared \.frozen\(\).*freeze"):
        g.forward({"input_ids": ids}, store=store)
    freeze(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _caching(g, {"input_ids": ids}, store)[1] == ["miss"]  # eval: its own value


def test_an_output_class_of_ones_own_is_refused_when_kept_not_when_read_back(
    tmp_path: Path,
) -> None:
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    import somatize
    from somatize import NoCodec

    @dataclass
    class Scores(ModelOutput):
        logits: torch.Tensor | None = None
        extra: torch.Tensor | None = None

    class Head(Node):
        def forward(self, input, ctx):
            return Scores(logits=input * 2)

    store = Store(tmp_path / "store")
    g = Graph.somatize(Head().cached())
    with pytest.raises(NoCodec, match=r"node 'head': .*Scores is a ModelOutput of your own"):
        g.forward(torch.ones(2), store=store)
    assert store.names() == []  # nothing kept that would fail every later forward
    somatize.codec(  # what the error suggests
        "test.Scores",
        Scores,
        dump=lambda o: somatize.codecs.encode(dict(o)),
        load=lambda b: Scores(**somatize.codecs.decode(b)),
    )
    assert _caching(g, torch.ones(2), store)[1] == ["miss"]
    out, said = _caching(g, torch.ones(2), store)
    assert (
        said == ["hit"] and type(out) is Scores and torch.equal(out.logits, torch.full((2,), 2.0))
    )


def test_a_wrapped_modules_code_change_is_warned_about_on_a_hit(tmp_path: Path) -> None:
    # the code version noted beside a kept value is the wrapped module's class's, not
    # Node.of's own (which never changes when the user edits their model)
    net = tmp_path / "netmod.py"
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            from netmod import Net
            from somatize import Graph, Node

            said = []
            g = Graph.somatize(Node.of(Net()).cached())
            out = g.forward(torch.ones(2), store=sys.argv[1], watching=said.append)
            print(out.tolist(), [f.get("cache") for f in said if f["fact"] == "ran"])
            """
        )
    )
    ran = []
    for k in (2, 3):
        net.write_text(
            "import torch\n\n\nclass Net(torch.nn.Module):\n"
            f"    def forward(self, x):\n        return x * {k}\n"
        )
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "store")],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        ran.append(done)
    assert ran[0].stdout.strip() == "[2.0, 2.0] ['miss']"
    assert "another version of its code" not in ran[0].stderr
    assert ran[1].stdout.strip() == "[2.0, 2.0] ['hit']"  # the key is the same: told, not hidden
    assert "node 'net': the cached value was kept by another version" in ran[1].stderr


def test_a_state_dict_is_kept_and_loads_into_a_fresh_model(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    model, ids = _gpt2()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # not the seed's weights
    store.keep("weights", model.state_dict())  # an OrderedDict of tensors
    back = Store(tmp_path / "store").recall("weights")
    assert type(back) is type(model.state_dict()) and list(back) == list(model.state_dict())
    fresh, _ = _gpt2()
    fresh.load_state_dict(back)
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_keeping_a_model_itself_is_refused_saying_to_keep_its_state_dict(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    model, _ = _gpt2()
    for value, at in (
        (model, "GPT2LMHeadModel"),
        ({"backbone": [model]}, "GPT2LMHeadModel in the value kept as 'model' at ['backbone'][0]"),
        (Node.of(model), "somatize.node.Wrapped"),  # the node standing for it
    ):
        with pytest.raises(somatize.NoCodec) as refused:
            store.keep("model", value)
        said = str(refused.value)
        assert at in said
        assert "model.state_dict()" in said and "load_state_dict" in said
        assert "Trainer.export()" in said and "somatize.codec(" not in said
    assert store.resolve("model") is None  # refused: nothing bound
    store.keep("model", model.state_dict())  # what it said to keep is kept
    assert list(store.recall("model")) == list(model.state_dict())


def test_loading_weights_into_a_module_cached_without_frozen_misses(tmp_path: Path) -> None:
    # a module with no parameter asking for a gradient may be cached without .frozen(): its
    # state is keyed as the argument of Node.of, and a load_state_dict reaches that key too
    store = Store(tmp_path / "store")
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).requires_grad_(False).eval()
    g = Graph.somatize(Node.of(lin).cached())
    x = torch.ones(1, 3)
    assert _caching(g, x, store)[1] == ["miss"]
    lin.load_state_dict({"weight": torch.eye(3), "bias": torch.zeros(3)})
    out, said = _caching(g, x, store)
    assert said == ["miss"] and torch.equal(out, x)


def test_a_compiled_model_is_cached_keyed_by_the_model_it_compiled(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    compiled = torch.compile(net, backend="eager")  # a torch.compile wrapper, as any backend's
    g = Graph.somatize(Node.of(compiled).frozen().cached())
    freeze(g)
    x = torch.randn(2, 3)
    first, said = _caching(g, x, store)
    assert said == ["miss"]
    again, said = _caching(g, x, store)
    assert said == ["hit"] and torch.equal(again, first)
    eager = Graph.somatize(Node.of(net).frozen().cached())  # the same weights, not compiled:
    assert _caching(eager, x, store)[1] == ["miss"]  # its own value, not the compiled one's
    net.load_state_dict({k: v + 1 for k, v in net.state_dict().items()})
    out, said = _caching(g, x, store)  # the weights it compiled changed: computed anew
    assert said == ["miss"] and torch.equal(out, net(x))


def test_a_torchscript_model_is_cached_under_a_salt(tmp_path: Path) -> None:
    # its state lives in C++ (no key reads it: a salt says which it is), and it takes no hooks
    store = Store(tmp_path / "store")
    torch.manual_seed(0)
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()))
    for p in scripted.parameters():
        p.requires_grad = False
    g = Graph.somatize(Node.of(scripted).frozen().cached(salt="v1"))
    x = torch.randn(2, 3)
    first, said = _caching(g, x, store)
    assert said == ["miss"]
    again, said = _caching(g, x, store)
    assert said == ["hit"] and torch.equal(again, first) and torch.equal(again, scripted(x))
