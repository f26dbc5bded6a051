"""Split learning and federated averaging as a researcher runs them: the suite's GPT-2 and
ResNet (tests/models/zoo.py, small configs, random init, float64, dropout off) with part of
the model on a real worker process on 127.0.0.1, trained by `Trainer`, against the same
training written in plain torch in one process."""

from __future__ import annotations

import copy
import os
import signal
import socket
import threading
import time

import pytest
import torch
from models import zoo
from torch import nn

from somatize import Broker, Graph, Node, Store, Worker
from somatize.remote import StateLost
from somatize.torch import Split, Trainer, fedavg, gather, parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")

SPAWN = ["--threads", "1"]


@pytest.fixture(scope="module")
def standing():
    """One worker process for the tests of this file that need no worker of their own: each
    reaches it through brokers of its own (sessions of their own), as separate clients do."""
    worker = Worker.spawn(SPAWN, mode="network")
    yield worker
    worker.stop()


def _at(worker):
    """Another client's declaration of a worker already standing."""
    return Worker.at(worker.address, token=worker.token)


class Embed(nn.Module):
    """GPT-2's token and position embeddings (they stay with the data)."""

    def __init__(self, t):
        super().__init__()
        self.wte, self.wpe = t.wte, t.wpe

    def forward(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))


class Blocks(nn.Module):
    """GPT-2's blocks and final norm (the part on the worker)."""

    def __init__(self, t):
        super().__init__()
        self.h, self.ln_f = t.h, t.ln_f

    def forward(self, h):
        for block in self.h:
            out = block(h)
            h = out[0] if isinstance(out, tuple) else out
        return self.ln_f(h)


class Head(nn.Module):
    """GPT-2's language-model head (tied to the token embedding: both stay here)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, h):
        return self.lm(h)


def _loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, zoo.VOCAB), y.reshape(-1))


def _gpt2():
    model = zoo.gpt2().model.double()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _pieces(model):
    t = model.transformer
    return Embed(t), Blocks(t), Head(model.lm_head)


def _batches(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(1, zoo.VOCAB, (4, zoo.SEQ), generator=gen),
            torch.randint(0, zoo.VOCAB, (4, zoo.SEQ), generator=gen),
        )
        for _ in range(n)
    ]


def _trainer(model, broker, **kw):
    emb, blocks, head = _pieces(model)
    g = Graph.somatize(
        Node.of(emb).named("emb")
        >> Node.of(blocks).named("blocks").at("w")
        >> Node.of(head).named("head")
    )
    trains = {"blocks": Split(torch.optim.SGD, lr=0.1)}
    opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
    return Trainer(g, objective=_loss, optimizer=opt, trains=trains, broker=broker, **kw)


def _by_hand(model, batches, every=1, micro=1):
    """The same training in plain torch, in one process: its losses (each the mean over its
    micro pieces)."""
    emb, blocks, head = _pieces(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, (x, y) in enumerate(batches):
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = _loss(head(blocks(emb(xs))), ys)
            (loss / (every * micro)).backward()
            total += loss.item() / micro
        losses.append(total)
        if (i + 1) % every == 0:
            opt.step()
            opt.zero_grad()
    return losses


def _same_weights(exported, module):
    for key, want in module.state_dict().items():
        assert torch.allclose(exported[key], want, rtol=0, atol=1e-12), key


@pytest.mark.parametrize(("every", "micro"), [(2, 2)])
def test_gpt2_blocks_on_a_worker_with_every_and_micro_train_as_in_one_process(
    every, micro, standing
):
    model = _gpt2()
    ref = copy.deepcopy(model)
    batches = _batches(4)
    with Broker.embedded({"w": _at(standing)}) as b:
        t = _trainer(model, b, every=every, micro=micro)
        losses = [t.step(batch) for batch in batches]
        learnt = t.export()
    assert losses == pytest.approx(_by_hand(ref, batches, every, micro), rel=1e-12)
    _same_weights(learnt["blocks"], _pieces(ref)[1])


def test_exported_weights_loaded_into_a_new_trainer_through_a_new_broker_train_on_as_one_run(
    standing,
):
    model = _gpt2()
    ref = copy.deepcopy(model)
    batches = _batches(4)
    with Broker.embedded({"w": _at(standing)}) as b:
        t = _trainer(model, b)
        first = [t.step(batch) for batch in batches[:2]]
        kept = t.export()
    fresh = _gpt2()  # another process's model, at its own init: only the weights carry over
    torch.manual_seed(9)
    for p in fresh.parameters():
        p.data.normal_()
    with Broker.embedded({"w": _at(standing)}) as b:
        t = _trainer(fresh, b)
        t.load(kept)
        then = [t.step(batch) for batch in batches[2:]]
        learnt = t.export()
    assert first + then == pytest.approx(_by_hand(ref, batches), rel=1e-12)
    _same_weights(learnt["blocks"], _pieces(ref)[1])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_restarted_mid_run_goes_on_only_from_weights_read_back():
    port, token = _free_port(), "k" * 64
    listen = [*SPAWN, "--listen", f"127.0.0.1:{port}"]
    model = _gpt2()
    ref = copy.deepcopy(model)
    batches = _batches(5)
    first = Worker.spawn(listen, mode="network", token=token)
    b = Broker.embedded({"w": Worker.at(f"127.0.0.1:{port}", token=token)})
    second = None
    try:
        t = _trainer(model, b)
        losses = [t.step(batches[0])]
        kept = t.export()
        t.step(batches[1])  # learnt there, not read back
        os.kill(first.pid, signal.SIGKILL)
        first.process.wait(10)
        second = Worker.spawn(listen, mode="network", token=token)
        with pytest.raises(StateLost, match="blocks") as lost:
            t.step(batches[1])
        with pytest.raises(StateLost):  # asked again: still refused, nothing stale
            t.export()
        for key, v in kept["blocks"].items():  # the blocks as last read back
            assert torch.equal(lost.value.exported["blocks"][key], v), key
        t.load(kept)  # the whole run as last read back (the nodes here had gone on)
        losses += [t.step(batch) for batch in batches[1:3]]
        t.export()  # read back: a restart now loses nothing
        os.kill(second.pid, signal.SIGKILL)
        second.process.wait(10)
        second = Worker.spawn(listen, mode="network", token=token)
        losses += [t.step(batch) for batch in batches[3:]]
        learnt = t.export()
    finally:
        b.close()
        for w in (first, second):
            if w is not None:
                w.stop()
    assert losses == pytest.approx(_by_hand(ref, batches), rel=1e-12)
    _same_weights(learnt["blocks"], _pieces(ref)[1])


def test_two_trainers_on_one_worker_each_train_as_alone(standing):
    one, other = _gpt2(), _gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    refs = [copy.deepcopy(one), copy.deepcopy(other)]
    batches = _batches(3)
    with Broker.embedded({"w": _at(standing)}) as b1, Broker.embedded({"w": _at(standing)}) as b2:
        trainers = [_trainer(one, b1), _trainer(other, b2)]
        losses = [[], []]
        for batch in batches:  # interleaved, step by step
            for k, t in enumerate(trainers):
                losses[k].append(t.step(batch))
        learnt = [t.export() for t in trainers]
    for k in range(2):
        assert losses[k] == pytest.approx(_by_hand(refs[k], batches), rel=1e-12)
        _same_weights(learnt[k]["blocks"], _pieces(refs[k])[1])


def test_a_client_with_the_wrong_token_or_curve_key_is_told_so_at_once(standing):
    import zmq

    ids = _batches(1)[0][0]
    model = _gpt2()
    emb, blocks, head = _pieces(model)
    g = Graph.somatize(Node.of(emb) >> Node.of(blocks).named("blocks").at("w") >> Node.of(head))
    plain = standing
    sealed = Worker.spawn(SPAWN, mode="network", encrypt=True)
    try:
        wrong = Worker.at(plain.address, token="x" * 64)
        start = time.monotonic()
        with Broker.embedded({"w": wrong}) as b, pytest.raises(PermissionError, match="token"):
            g.forward(ids, broker=b)
        assert time.monotonic() - start < 5
        other_key = zmq.curve_keypair()[0].decode()
        bad = Worker.at(sealed.address, token=sealed.token, server_key=other_key)
        start = time.monotonic()
        with Broker.embedded({"w": bad}) as b, pytest.raises(PermissionError, match="CURVE key"):
            g.forward(ids, broker=b)
        assert time.monotonic() - start < 5
        wrong = Worker.at(sealed.address, token="x" * 64, server_key=sealed.server_key)
        with Broker.embedded({"w": wrong}) as b, pytest.raises(PermissionError, match="token"):
            g.forward(ids, broker=b)
        good = Worker.at(sealed.address, token=sealed.token, server_key=sealed.server_key)
        with Broker.embedded({"w": good}) as b, torch.no_grad():
            assert torch.allclose(
                g.forward(ids, broker=b), head(blocks(emb(ids))), rtol=0, atol=1e-12
            )
    finally:
        sealed.stop()


class Stem(nn.Module):
    """ResNet's embedder (here)."""

    def __init__(self, resnet):
        super().__init__()
        self.embedder = resnet.embedder

    def forward(self, x):
        return self.embedder(x)


class Stages(nn.Module):
    """ResNet's residual stages, BatchNorm in each (on the worker)."""

    def __init__(self, resnet):
        super().__init__()
        self.encoder = resnet.encoder

    def forward(self, h):
        return self.encoder(h).last_hidden_state


class Classify(nn.Module):
    """Pooling and the classifier (here)."""

    def __init__(self, model):
        super().__init__()
        self.pooler, self.classifier = model.resnet.pooler, model.classifier

    def forward(self, h):
        return self.classifier(self.pooler(h))


def _resnet_pieces(model):
    return Stem(model.resnet), Stages(model.resnet), Classify(model)


def test_resnet_stages_on_a_worker_train_batchnorm_and_all_as_in_one_process(standing):
    model = zoo.resnet().model.double()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(4)
    batches = [
        (torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 4, 2]))
        for _ in range(3)
    ]
    stem, stages, classify = _resnet_pieces(model)
    g = Graph.somatize(
        Node.of(stem).named("stem")
        >> Node.of(stages).named("stages").at("w")
        >> Node.of(classify).named("classify")
    )
    trains = {"stages": Split(torch.optim.SGD, lr=0.05, momentum=0.9)}
    opt = torch.optim.SGD(parameters(g, without=trains), lr=0.05, momentum=0.9)
    with Broker.embedded({"w": _at(standing)}) as b:
        t = Trainer(
            g, objective=nn.functional.cross_entropy, optimizer=opt, trains=trains, broker=b
        )
        losses = [t.step(batch) for batch in batches]
        learnt = t.export()
        model.eval()
        with torch.no_grad():
            evaluated = g.forward(batches[0][0], broker=b)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    want = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(x).logits, y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-10)
    _same_weights(learnt["stages"], _resnet_pieces(ref)[1])  # running statistics too
    ref.eval()
    with torch.no_grad():
        assert torch.allclose(evaluated, ref(batches[0][0]).logits, rtol=0, atol=1e-10)


def test_federated_averaging_of_three_clients_with_one_slow_and_one_gone(tmp_path, standing):
    store = Store(tmp_path / "store")
    batches = _batches(6)
    clients = [_gpt2() for _ in range(3)]
    sizes = [2, 1, 3]
    brokers = [Broker.embedded({"w": _at(standing)}) for _ in range(3)]
    try:
        trainers = [_trainer(m, b) for m, b in zip(clients, brokers, strict=True)]
        exports = []
        for k, t in enumerate(trainers):  # each client its own data
            for batch in batches[2 * k : 2 * k + 2]:
                t.step(batch)
            exports.append(t.export())
        answers, errors = {}, {}

        def client(k, late, round=0, within=20):
            time.sleep(late)
            try:
                answers[k] = gather(
                    store,
                    exports[k],
                    run="fed",
                    round=round,
                    clients=3,
                    mine=k,
                    size=sizes[k],
                    within=within,
                    asking=0.02,
                )
            except Exception as error:  # noqa: BLE001  (reported below)
                errors[k] = error

        threads = [
            threading.Thread(target=client, args=(k, 1.0 if k == 2 else 0)) for k in range(3)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        by_hand = {}
        for nid in exports[0]:
            by_hand[nid] = {}
            for key, v in exports[0][nid].items():
                stacked = torch.stack([e[nid][key].double() for e in exports])
                w = torch.tensor(sizes, dtype=torch.float64).reshape(-1, *[1] * v.dim())
                by_hand[nid][key] = ((stacked * w).sum(0) / sum(sizes)).to(v.dtype)
        averaged = [*answers.values(), fedavg(exports, sizes=sizes)]
        for k in range(4):
            for nid, keys in by_hand.items():
                for key, v in keys.items():
                    assert torch.allclose(averaged[k][nid][key], v, rtol=0, atol=1e-12), (
                        k,
                        nid,
                        key,
                    )
        for t in trainers:  # each goes on from the average, on the worker too
            t.load(answers[0])
            for nid, keys in t.export().items():
                for key, v in keys.items():
                    assert torch.equal(v, answers[0][nid][key]), (nid, key)
        # round 1: client 2 is gone; the others are told who, within the time given
        exports = [t.export() for t in trainers]
        answers.clear()
        start = time.monotonic()
        threads = [threading.Thread(target=client, args=(k, 0, 1, 1)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert time.monotonic() - start < 30
        assert not answers and sorted(errors) == [0, 1]
        for error in errors.values():
            assert isinstance(error, TimeoutError)
            assert "client(s) [2] never turned up" in str(error)
    finally:
        for b in brokers:
            b.close()


class Slow(nn.Module):
    """A module whose forward takes `pause` seconds more (a large batch on a slow machine)."""

    def __init__(self, inner, pause):
        super().__init__()
        self.inner, self.pause = inner, pause

    def forward(self, h):
        time.sleep(self.pause)
        return self.inner(h)


def test_a_request_longer_than_the_session_timeout_does_not_expire_its_own_session():
    model = _gpt2()
    ref = copy.deepcopy(model)
    emb, blocks, head = _pieces(model)
    g = Graph.somatize(
        Node.of(emb).named("emb")
        >> Node.of(Slow(blocks, 1.5)).named("blocks").at("w")
        >> Node.of(head).named("head")
    )
    trains = {"blocks": Split(torch.optim.SGD, lr=0.1)}
    opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
    timeout = [*SPAWN, "--session-timeout", "1"]
    batches = _batches(1)
    with Broker.embedded({"w": Worker.spawn(timeout, mode="network")}) as b:
        t = Trainer(g, objective=_loss, optimizer=opt, trains=trains, broker=b)
        losses = [t.step(batch) for batch in batches]  # its forward took 1.5 s; used till then
        learnt = t.export()
    assert losses == pytest.approx(_by_hand(ref, batches), rel=1e-12)
    _same_weights(
        {k.removeprefix("inner."): v for k, v in learnt["blocks"].items()}, _pieces(ref)[1]
    )


def test_a_curve_key_is_taken_as_zmq_makes_it_and_a_malformed_one_refused_when_declared(standing):
    import zmq

    sealed = Worker.spawn(SPAWN, mode="network", encrypt=True)
    try:
        model = _gpt2()
        emb, blocks, head = _pieces(model)
        g = Graph.somatize(Node.of(emb) >> Node.of(blocks).at("w") >> Node.of(head))
        ids = _batches(1)[0][0]
        as_bytes = sealed.server_key.encode()  # zmq.curve_keypair() gives bytes
        good = Worker.at(sealed.address, token=sealed.token, server_key=as_bytes)
        with Broker.embedded({"w": good}) as b, torch.no_grad():
            assert torch.allclose(
                g.forward(ids, broker=b), head(blocks(emb(ids))), rtol=0, atol=1e-12
            )
        # given a key, a worker that does not encrypt
        keyed = Worker.at(standing.address, token=standing.token, server_key=sealed.server_key)
        with (
            Broker.embedded({"w": keyed}) as b,
            pytest.raises(PermissionError, match=r"or it does not encrypt \(leave server_key"),
        ):
            g.forward(ids, broker=b)
        for bad in ("abc", "~" * 40, zmq.curve_keypair()[1][:35], 12):
            with pytest.raises(ValueError, match="server_key is the worker's CURVE public key"):
                Worker.at(sealed.address, token=sealed.token, server_key=bad)
    finally:
        sealed.stop()


def test_a_graph_built_anew_around_the_trained_modules_is_not_run_from_older_weights(standing):
    model = _gpt2()
    ref = copy.deepcopy(model)
    batches = _batches(2)
    ids = batches[1][0]
    _by_hand(ref, batches[:1])
    with torch.no_grad():
        want = _pieces(ref)[2](_pieces(ref)[1](_pieces(ref)[0](ids)))
    with Broker.embedded({"w": _at(standing)}) as b:
        t = _trainer(model, b)
        t.step(batches[0])
        emb, _, head = _pieces(model)  # a new wrapper around the same blocks, the same broker
        again = Graph.somatize(
            Node.of(emb)
            >> Node.of(Blocks(model.transformer)).named("blocks").at("w")
            >> Node.of(head)
        )
        with torch.no_grad():
            with pytest.raises(StateLost, match="learnt on host 'w'"):
                again.forward(ids, broker=b)  # it would run the blocks as they were before
            t.export()  # read back: the copy here is current
            assert torch.allclose(again.forward(ids, broker=b), want, rtol=0, atol=1e-12)
