"""A real model split across a real worker process, as a user would: transformers' BERT cut
after its embeddings, its encoder trained on a worker by `Split`, against the same training
written in plain torch in one process (float64)."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from models import zoo
from torch import nn

from somatize import Broker, Graph, Node, Worker
from somatize.remote import StateLost, WorkerLost
from somatize.torch import Split, Trainer, parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")

VOCAB, HIDDEN = zoo.VOCAB, 32  # the suite's BERT: its vocabulary, its width


class Embeddings(nn.Module):
    """BERT's embeddings on token ids (the part that stays with the data)."""

    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, ids):
        return self.emb(input_ids=ids)


class Encoder(nn.Module):
    """BERT's encoder, giving its last hidden state (the part on the worker)."""

    def __init__(self, enc):
        super().__init__()
        self.enc = enc

    def forward(self, h):
        return self.enc(h).last_hidden_state


def _bert():
    """The suite's BERT (tests/models/zoo.py) with dropout off (so that the run is the same
    whatever the random stream), in float64, and a token head."""
    model = zoo.bert(dropout=0.0).model.double()
    return model, nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)


def _loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _batches(n=4):
    gen = torch.Generator().manual_seed(2)
    return [
        (
            torch.randint(1, VOCAB, (3, 8), generator=gen),
            torch.randint(0, VOCAB, (3, 8), generator=gen),
        )
        for _ in range(n)
    ]


def _split(bert, head, broker):
    """The graph cut after the embeddings, the encoder on host "w" trained by Split(Adam),
    the rest by Adam here."""
    g = Graph.somatize(
        Node.of(Embeddings(bert.embeddings)).named("emb")
        >> Node.of(Encoder(bert.encoder)).named("enc").at("w")
        >> Node.of(head).named("head")
    )
    trains = {"enc": Split(torch.optim.Adam, lr=1e-2)}
    t = Trainer(
        g,
        objective=_loss,
        optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2),
        trains=trains,
        broker=broker,
    )
    return g, t


def _by_hand(bert, head, batches):
    """The same training in plain torch, in one process: its losses."""
    opt = torch.optim.Adam(
        [*bert.embeddings.parameters(), *bert.encoder.parameters(), *head.parameters()], lr=1e-2
    )
    losses = []
    for ids, y in batches:
        opt.zero_grad()
        loss = _loss(head(bert.encoder(bert.embeddings(input_ids=ids)).last_hidden_state), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _close(a, b):
    return torch.allclose(a, b, rtol=0, atol=1e-10)


def test_bert_split_after_its_embeddings_trains_on_a_worker_as_plain_torch_in_one_process():
    bert, head = _bert()
    ref_bert, ref_head = copy.deepcopy(bert), copy.deepcopy(head)
    broker = Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        g, t = _split(bert, head, broker)
        batches = _batches()
        losses = [t.step(b) for b in batches]
        assert losses == pytest.approx(_by_hand(ref_bert, ref_head, batches), rel=1e-12)
        learnt = t.export()["enc"]
        for key, want in ref_bert.encoder.state_dict().items():
            assert _close(learnt[f"enc.{key}"], want), key
    finally:
        broker.close()


def test_closing_the_broker_says_what_was_not_read_back_and_no_broker_goes_on_from_it():
    import warnings

    bert, head = _bert()
    ref_bert, ref_head = copy.deepcopy(bert), copy.deepcopy(head)
    batches = _batches()
    before = copy.deepcopy(bert.encoder.state_dict())
    with pytest.warns(RuntimeWarning, match=r"\['enc'\] learnt on a worker.*Trainer.export"):
        with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as b:
            g, t = _split(bert, head, b)
            t.step(batches[0])
    # the copy here never learnt, and a new broker does not send it on as if it had
    assert all(torch.equal(v, bert.encoder.state_dict()[k]) for k, v in before.items())
    ids = batches[0][0]
    with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as again:
        with pytest.raises(StateLost, match="node 'enc' holds weights that learnt on host 'w'"):
            g.forward(ids, broker=again)
    # read back before closing: nothing to say, and the copy here is what was learnt
    bert, head = copy.deepcopy(ref_bert), copy.deepcopy(ref_head)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as b:
            g, t = _split(bert, head, b)
            for batch in batches:
                t.step(batch)
            t.export()
    _by_hand(ref_bert, ref_head, batches)
    with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as again:
        out = g.forward(ids, broker=again)  # a new worker is sent what was read back
    want = ref_head(ref_bert.encoder(ref_bert.embeddings(input_ids=ids)).last_hidden_state)
    assert _close(out, want)


def test_a_worker_killed_after_training_names_the_nodes_whose_learning_went_with_it():
    bert, head = _bert()
    worker = Worker.spawn(["--threads", "1"], mode="network")
    broker = Broker.embedded({"w": worker})
    try:
        g, t = _split(bert, head, broker)
        batches = _batches()
        t.step(batches[0])
        kept = t.export()
        t.step(batches[1])
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.wait(10)
        with pytest.raises(WorkerLost) as lost:
            t.step(batches[2])
        said = "\n".join(getattr(lost.value, "__notes__", []))
        assert "['enc'] had learnt there" in said and "Trainer.load" in said
        with pytest.warns(RuntimeWarning, match=r"\['enc'\] learnt on a worker"):
            broker.close()
        # the copy here holds what was last read back
        for key, v in kept["enc"].items():
            assert torch.equal(bert.encoder.state_dict()[key.removeprefix("enc.")], v), key
    finally:
        broker.close()
    # a new worker, through a new broker, is not sent the copy here as if it were current
    with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as again:
        t = _split(bert, head, again)[1]
        with pytest.raises(StateLost, match="node 'enc' holds weights that learnt on host 'w'"):
            t.step(batches[2])
        with pytest.raises(StateLost):  # refused again: nothing goes on from it silently
            g.forward(batches[2][0], broker=again)
        try:
            t.step(batches[2])
        except StateLost as error:
            lost_too = error.exported
        t.load(lost_too)
        assert all(torch.equal(lost_too["enc"][k], v) for k, v in kept["enc"].items())
        t.step(batches[2])  # resumed from the last weights read back
        t.export()  # and read back, so closing loses nothing


def test_a_node_that_learnt_through_one_broker_is_not_sent_on_by_another_until_read_back():
    bert, head = _bert()
    batches = _batches(2)
    with (
        Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as one,
        Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as other,
    ):
        g, t = _split(bert, head, one)
        t.step(batches[0])
        ids = batches[1][0]
        with pytest.raises(StateLost, match="through another broker"):
            g.forward(ids, broker=other)  # it would run the encoder as it was before the step
        t.export()  # read back: the copy here is current
        with torch.no_grad():
            assert _close(g.forward(ids, broker=other), g.forward(ids, broker=one))


def test_a_frozen_node_on_a_worker_learnt_nothing_and_goes_on_through_another_broker():
    bert, head = _bert()
    g = Graph.somatize(
        Node.of(Embeddings(bert.embeddings)).named("emb")
        >> Node.of(Encoder(bert.encoder)).named("enc").at("w").frozen()
        >> Node.of(head).named("head").at("w")
    )
    ids = _batches(1)[0][0]
    spawn = ["--threads", "1"]
    with (
        Broker.embedded({"w": Worker.spawn(spawn, mode="network")}) as one,
        Broker.embedded({"w": Worker.spawn(spawn, mode="network")}) as other,
    ):
        trains = {"head": Split(torch.optim.SGD, lr=0.1)}
        opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
        t = Trainer(g, objective=_loss, optimizer=opt, trains=trains, broker=one)
        t.step(_batches(1)[0])
        with pytest.raises(StateLost) as lost:  # the frozen encoder is sent; the head is not
            g.forward(ids, broker=other)
        assert lost.value.nodes == ["head"]
        t.export()
        with torch.no_grad():
            assert _close(g.forward(ids, broker=other), g.forward(ids, broker=one))
