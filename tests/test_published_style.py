"""Code written for the published somatize 1.0.1 runs here unchanged.

Each test is a script written the published way, asserting what the published package
documents; where this project does better, that is asserted beside it. Each area keeps a
section of its own below.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import cross_entropy
from torch.optim import SGD

from somatize import Graph, Node, Opaque, Recorder, Store, codecs_registered
from somatize.torch import Trainer, fedavg, gather, parameters

# -- store --


class Encoder(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())

    def forward(self, input, ctx):
        return Opaque(self.net(input.value if isinstance(input, Opaque) else input))


class Head(Node, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)
        self.lin = nn.Linear(16, 3)

    def forward(self, input, ctx):
        return self.lin(input.value if isinstance(input, Opaque) else input)


def batches(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (Opaque(torch.randn(6, 8, generator=gen)), torch.randint(0, 3, (6,), generator=gen))
        for _ in range(n)
    ]


def test_keep_an_opaque_value_keeps_what_it_wraps(tmp_path):
    store = Store(tmp_path / "kept")
    x = torch.randn(4, 8)
    digest = store.keep("input", Opaque(x))
    assert digest == store.keep("bare", x)
    assert torch.equal(store.recall("input"), x)
    store.keep("batch", (Opaque(x), Opaque(torch.tensor([1, 2]))))
    back = store.recall("batch")
    assert type(back) is tuple and torch.equal(back[0], x)


def test_the_tensor_codec_is_torch_tensor_and_stores_kept_before_read_back(tmp_path):
    assert "torch.Tensor" in codecs_registered()
    # bytes a store kept while the codec was registered as "tensor": {"w": arange(3) int16}
    old = bytes.fromhex(
        "81a177c74e1040000000000000007b2274656e736f72223a7b226474797065223a22493136222c22"
        "7368617065223a5b335d2c22646174615f6f666673657473223a5b302c365d7d7d2020202020000001"
        "000200"
    )
    store = Store(tmp_path / "old")
    store.bind("weights", store.put(old))
    back = store.recall("weights")
    assert back["w"].dtype == torch.int16 and back["w"].tolist() == [0, 1, 2]
    assert store.keep("again", back) == store.resolve("weights").digest  # the same bytes


def test_a_recorder_summarising_the_loss_and_the_run_read_back(tmp_path):
    store = Store(tmp_path / "runs")
    torch.manual_seed(0)
    g = Graph.somatize(Encoder() >> Head())
    recorder = Recorder(store, run="tuesday", summarising=["loss"])
    t = Trainer(g, objective=cross_entropy, optimizer=SGD(parameters(g), lr=0.1), watching=recorder)
    t.fit(batches(), epochs=2)
    recorder.close()

    import somatize.record

    runs = somatize.record.runs(store)
    assert list(runs.columns) == ["run", "forwards", "broke", "took_us", "first", "last"]
    assert runs["run"].tolist() == ["tuesday"] and runs["forwards"].tolist() == [8]
    assert runs["broke"].tolist() == [0] and runs["took_us"].iloc[0] > 0
    forwards = somatize.record.forwards(store, "tuesday")
    curve = somatize.record.curve(store, "tuesday")
    assert len(curve) == 8 and curve["step"].tolist() == list(range(8))
    # every record's meta carries the last loss of its forward, as the loss facts said
    assert forwards["loss.value"].tolist() == curve["value"].tolist()
    for i, loss in enumerate(curve["value"]):
        assert store.resolve(f"run/tuesday/{i}").get("loss.value") == loss
        assert isinstance(loss, float) and loss > 0
    nodes = somatize.record.nodes(store, "tuesday")
    assert nodes["node"].tolist() == ["encoder", "head"] and nodes["ran"].tolist() == [8, 8]


def test_fedavg_and_gather_as_written(tmp_path):
    torch.manual_seed(0)
    clients = []
    for k in range(2):
        g = Graph.somatize(Encoder() >> Head())
        t = Trainer(g, objective=cross_entropy, optimizer=SGD(parameters(g), lr=0.1))
        t.fit(batches(seed=k))
        clients.append(t)
    average = fedavg([client.export() for client in clients], sizes=[900, 100])
    first, second = (c.export()["head"]["lin.weight"].double() for c in clients)
    expected = 0.9 * first + 0.1 * second
    rtol = 8 * torch.finfo(torch.float32).eps
    assert torch.allclose(average["head"]["lin.weight"].double(), expected, rtol=rtol, atol=rtol)

    store = Store(tmp_path / "fed")
    answers = {}

    def client(k):
        answers[k] = gather(
            store,
            clients[k].export(),
            run="fed",
            round=0,
            clients=2,
            mine=k,
            size=10 * (k + 1),
            within=60,
            asking=0.02,
        )

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in range(2):
        clients[k].load(answers[k])
    assert torch.equal(answers[0]["head"]["lin.bias"], answers[1]["head"]["lin.bias"])


def test_better_a_hostile_record_is_left_out_and_the_round_still_completes(tmp_path):
    store = Store(tmp_path / "fed")
    store.keep("fed/round/0/client/1", {"head": "not weights"})  # someone else's bytes
    mine = {"head": {"w": torch.ones(2)}}
    with pytest.warns(RuntimeWarning, match="client 1"):
        average = gather(store, mine, run="fed", round=0, clients=2, mine=0, within=60)
    assert torch.equal(average["head"]["w"], torch.ones(2))


# -- inside --


class ConvEncoder(Node, nn.Module):
    """As the published page declares a node: a module whose forward takes (input, ctx)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, input, ctx):
        return Opaque(self.net(input))  # the published way: every value crossing an edge


class ConvHead(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, input, ctx):
        return self.fc(torch.flatten(input, 1))


def _published_graph():
    torch.manual_seed(0)
    return Graph.somatize(ConvEncoder().named("encoder") >> ConvHead().named("head"))


def test_inside_the_reference_pages_figure_line_runs():
    from somatize.torch import architecture

    g = _published_graph()
    x = Opaque(torch.randn(4, 1, 6, 6))
    fig = g.figure(inside=architecture(g, x))  # "g.figure(inside=architecture(g, x))"
    assert set(fig.inside) == {"encoder", "head"}
    inside = architecture(g, x)
    assert [x.path for x in inside["encoder"].layers] == ["net", "net.0", "net.1", "net.2"]
    assert inside["head"].layer("fc").shape == [4, 3]


def test_inside_kind_of_by_role_and_a_transformer_layer_is_attention():
    from somatize.torch import kind_of

    class FancyNorm(nn.Module):
        pass

    assert kind_of(nn.TransformerEncoderLayer(8, 2)) == "attention"
    assert kind_of(nn.TransformerDecoderLayer(8, 2)) == "attention"
    assert kind_of(FancyNorm()) == "norm"  # "a class ... that ends in Norm is a normalisation"
    assert kind_of(nn.Conv2d(1, 1, 1)) == "conv"


def test_inside_traced_answers_an_inside_or_none():
    from somatize.torch import Inside, traced

    enc = nn.TransformerEncoderLayer(8, 2, 16)
    assert traced(enc) is None  # "a module that needs a forward answers None"
    got = traced(enc, Opaque(torch.randn(5, 2, 8)))
    assert isinstance(got, Inside) and got.how == "traced"
    assert got.to_json() == traced(enc, torch.randn(5, 2, 8)).to_json()


def test_inside_probe_in_the_published_layout_opaque_or_not():
    from somatize.torch import probe

    g = _published_graph()
    x = torch.randn(4, 1, 6, 6)
    heard = []
    got = probe(g, Opaque(x), depth=0, most=48, probes=24, watching=heard.append)
    assert got == probe(g, x)
    for where, numbers in got.items():
        assert where in ("encoder", "head") or where.split(".")[0] in ("encoder", "head")
        assert {"signal_gain", "zero_frac_max", "sat_frac_max", "nan", "inf"} <= set(numbers)
    assert {"jacobian_gain", "jacobian_spread"} <= set(got["head.fc"])
    kinds = [f["fact"] for f in heard]
    assert "ran" in kinds and "finished" in kinds and "health" in kinds
    health = [f for f in heard if f["fact"] == "health"]
    assert all({"node", "inside", "step"} <= set(f) and f["step"] == 0 for f in health)
    assert {(f["node"], f["inside"]) for f in health} >= {("encoder", None), ("head", "fc")}


def test_inside_proxies_as_the_page_writes_them_opaque_or_not():
    from somatize.torch import EVERY, proxies, proxy

    g = _published_graph()
    x, y = torch.randn(8, 1, 6, 6), torch.arange(8) % 3
    scores = proxies(g, Opaque(x), target=Opaque(y), objective=F.cross_entropy)
    assert scores == proxies(g, x, target=y, objective=F.cross_entropy)
    assert list(scores) == list(EVERY)
    assert all(isinstance(v, float) and math.isfinite(v) for v in scores.values())
    # "without a target and an objective the three that read a loss are not in the answer"
    assert set(proxies(g, Opaque(x))) == {"synflow", "zen", "naswot", "jacob_cov"}
    assert proxy(g, Opaque(x), "synflow") == scores["synflow"]


def test_inside_better_a_model_as_it_is_in_every_tool():
    """**better:** any nn.Module as it is: Graph.somatize(model), Node.of, and every tool."""
    from somatize.figures import compare
    from somatize.torch import Trainer, architecture, probe, proxies

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.arange(6) % 2
    g = Graph.somatize(model)
    assert g.nodes() == ["sequential"]
    assert architecture(model, x)["sequential"].params == 58
    assert set(probe(model, x)) == {"sequential", "sequential.0", "sequential.1", "sequential.2"}
    assert "synflow" in proxies(model, x)
    assert list(compare({"mlp": model}, x).index) == ["mlp"]
    from somatize.figures import graph_figure

    fig = graph_figure(model, inside=architecture(model, x))
    assert [n["id"] for n in fig.plan["nodes"]] == ["sequential"] and fig.inside["sequential"]
    t = Trainer(
        model, objective=F.cross_entropy, optimizer=torch.optim.SGD(model.parameters(), 0.1)
    )
    assert math.isfinite(t.step((x, y)))
    chained = Graph.somatize(Node.of(model[:2]) >> Node.of(model[2]).named("head"))
    assert chained.nodes() == ["sequential", "head"]
    assert torch.equal(chained.forward(x), model(x))


# -- training --


class Features(Node, nn.Module):
    """Written the published way: what it produces crosses the edge in an Opaque."""

    def __init__(self, i: int = 8, o: int = 16) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, input, ctx):
        return Opaque(torch.relu(self.lin(input)))


class Classes(Node, nn.Module):
    def __init__(self, i: int = 16, o: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, input, ctx):
        return Opaque(self.lin(input))


class Tokens(Node):
    """A node with nothing to train."""

    def forward(self, input, ctx):
        return Opaque(input)


def _trained_net(seed: int = 0) -> Graph:
    torch.manual_seed(seed)
    return Graph.somatize(Features().named("encoder") >> Classes().named("head"))


def _train_data(n: int = 3, rows: int = 8):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 8, generator=gen), torch.randint(0, 4, (rows,), generator=gen))
        for _ in range(n)
    ]


def test_training_on_opaque_batches_takes_the_steps_of_the_bare_batches():
    from somatize.torch import Trainer, parameters

    g1, g2 = _trained_net(), _trained_net()
    t1 = Trainer(g1, objective=cross_entropy, optimizer=torch.optim.Adam(parameters(g1), lr=1e-3))
    t2 = Trainer(g2, objective=cross_entropy, optimizer=torch.optim.Adam(parameters(g2), lr=1e-3))
    for x, y in _train_data():
        assert t1.step((Opaque(x), Opaque(y))) == t2.step((x, y))
    for node, weights in t1.export().items():
        for key, value in weights.items():
            assert torch.equal(value, t2.export()[node][key]), (node, key)


def test_a_result_prints_as_one_line_with_its_steps_and_first_and_last_loss():
    from somatize.torch import Result, Trainer, parameters

    g = _trained_net()
    t = Trainer(g, objective=cross_entropy, optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
    result = t.fit(_train_data(), epochs=4)
    assert isinstance(result, Result) and len(result.history) == 12
    line = repr(result)
    assert "\n" not in line and "12 steps" in line
    assert f"{result.history[0]:.3g}" in line and f"{result.history[-1]:.3g}" in line
    assert result.loss == result.history[-1]


def test_a_bad_watching_or_auditing_can_be_caught_as_a_value_error():
    from somatize.torch import Trainer, parameters

    g = _trained_net()
    for bad in ({"watching": 42}, {"auditing": "yes"}):
        with pytest.raises(ValueError):
            Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD(parameters(g)), **bad)


def test_a_trainer_over_nothing_to_train_and_trains_on_a_node_without_parameters_are_refused():
    from somatize.torch import Split, Trainer, parameters

    g = Graph.somatize(Tokens().named("tok"))
    with pytest.raises(ValueError, match="nothing to train"):
        Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))]))
    torch.manual_seed(0)
    g = Graph.somatize(Tokens().named("tok") >> Features().named("encoder") >> Classes())
    trains = {"tok": Split(torch.optim.SGD, lr=0.1)}
    with pytest.raises(ValueError, match="'tok'"):
        Trainer(
            g,
            objective=cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
        )


def test_micro_pieces_of_an_input_and_a_target_of_other_lengths_are_refused():
    from somatize.torch import Trainer, parameters

    g = _trained_net()
    t = Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD(parameters(g)), micro=2)
    x, _ = _train_data(1)[0]
    with pytest.raises(ValueError, match="differ"):
        t.step((Opaque(x), Opaque(torch.zeros(4, dtype=torch.long))))


def test_an_optimizer_over_a_subset_trains_that_subset_and_the_rest_stays_as_in_torch():
    from somatize.torch import Trainer

    g = _trained_net()
    head = g.implementation("head")
    encoder_before = g.implementation("encoder").lin.weight.detach().clone()
    t = Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD(head.parameters(), lr=0.1))
    head_before = head.lin.weight.detach().clone()
    t.fit(_train_data())
    assert torch.equal(g.implementation("encoder").lin.weight, encoder_before)
    assert not torch.equal(head.lin.weight, head_before)


def test_no_gradient_names_the_parameters_of_a_cut_and_how_to_say_it_is_on_purpose():
    from somatize.torch import Greedy, NoGradient, Trainer, parameters

    torch.manual_seed(0)
    g = Graph.somatize(Features().named("front") >> Features(16, 16).named("body") >> Classes())
    trains = {"body": Greedy(torch.optim.SGD, head=nn.Linear(16, 4), lr=0.1)}
    t = Trainer(
        g,
        objective=cross_entropy,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
    )
    with pytest.raises(NoGradient, match=r"front\.lin\.weight.*without=\['front'\]"):
        t.step(_train_data(1)[0])


def test_the_learning_hole_a_technique_writes_learn_and_nothing_else():
    """The spec: "A technique writes learn(signal, ctx) and nothing else"; here a hand-written
    Split, stepped where the group closes."""
    from somatize.torch import Learning, Split, Trainer, parameters

    class Mine(Learning):
        def learn(self, signal, ctx):
            if signal is not None:
                torch.autograd.backward([self.waiting()], [signal])
            if self.closes():
                self.optimizer.step()
                self.optimizer.zero_grad()
            given = self.done()
            return given.grad if given is not None and given.requires_grad else None

    results = []
    for technique in (Mine, Split):
        torch.manual_seed(0)
        g = Graph.somatize(Features().named("front") >> Features(16, 16).named("body") >> Classes())
        trains = {"body": technique(torch.optim.SGD, lr=0.1)}
        t = Trainer(
            g,
            objective=cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
        )
        results.append(t.fit(_train_data()).history)
    assert results[0] == pytest.approx(results[1], abs=1e-6)


def test_better_the_same_hole_answered_four_ways():
    """Split, Greedy, Synthetic and ForwardForward each train the node they are given."""
    from somatize.torch import ForwardForward, Greedy, Split, Synthetic, Trainer, parameters

    SGD = torch.optim.SGD
    for trains in (
        {"body": Split(SGD, lr=0.1)},
        {"body": Synthetic(SGD, lr=0.1)},
        {"front": Greedy(SGD, head=nn.Linear(16, 4), lr=0.1)},
        {"front": ForwardForward(SGD, lr=0.1)},
    ):
        torch.manual_seed(0)
        g = Graph.somatize(Features().named("front") >> Features(16, 16).named("body") >> Classes())
        (nid,) = trains
        before = g.implementation(nid).lin.weight.detach().clone()
        t = Trainer(
            g,
            objective=cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
        )
        t.fit(_train_data(4), epochs=2)
        assert not torch.equal(g.implementation(nid).lin.weight, before), trains
