"""A worker's answers, in this process (`Server.handle`): what it builds, what it refuses before
importing anything, how it loads weights in two steps, and when it forgets a session."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch
from _remote_nodes import Lin

from somatize.remote import seal, wire
from somatize.remote.allowed import Allowed
from somatize.remote.server import Server

TOKEN = "t" * 64


class Client:
    """What a client does, by hand: ask for the salt, seal requests, open answers."""

    def __init__(self, server: Server, token: str = TOKEN) -> None:
        self.server = server
        answer, verified = server.handle([seal.SALT_ASK])
        assert verified is None  # the one question asked unsealed
        self.seal = seal.Seal(seal.derive(token, answer[1]))
        self.rid = 0

    def ask(self, message: dict, **kw: Any) -> dict:
        self.rid += 1
        frames = self.seal.seal(wire.encode({"rid": self.rid, "session": "s", **message}))
        reply, verified = self.server.handle(frames, **kw)
        assert verified
        return wire.decode(self.seal.open(reply))


def definition(cls: type, nid: str = "x", key: str = "k", **args: Any) -> dict:
    return {
        "key": key,
        "id": nid,
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "args": args,
        "state": None,
        "device": None,
    }


@pytest.fixture
def server():
    return Server(TOKEN, allowed=Allowed(["_remote_nodes"]))


def test_a_sealed_request_is_answered_and_anything_else_refused_unread(server):
    hello = Client(server).ask({"op": "hello"})
    assert hello["ok"] and list(hello["value"]["imports"]) == ["_remote_nodes"]
    wrong = Client(server, token="another token")
    reply, verified = server.handle(wrong.seal.seal(wire.encode({"op": "hello", "rid": 1})))
    assert (
        verified is False and seal.is_frame(reply[0], seal.REFUSED) and bytes(reply[2]) == b"seal"
    )
    reply, verified = server.handle([b"junk", b"more"])
    assert verified is False and bytes(reply[2]) == b"seal"
    bad = Client(server).ask({"op": "nope"})
    assert not bad["ok"] and "unknown request 'nope'" in bad["error"]["message"]


def test_a_sealed_message_that_is_not_a_request_is_answered_with_what_is_wrong(server):
    client = Client(server)
    reply, verified = server.handle(client.seal.seal([b"\x92\x01"]))  # msgpack cut short
    answer = wire.decode(client.seal.open(reply))
    assert verified and answer["rid"] is None and not answer["ok"]
    assert answer["error"]["qualname"] == "Malformed"


def test_an_error_whose_text_is_not_utf8_is_still_answered(server, monkeypatch):
    undecodable = b"/data/\xff.pt".decode("utf-8", "surrogateescape")  # as os names a file

    def fails(m: dict, connection: Any = None) -> Any:
        raise FileNotFoundError(f"no such file: {undecodable}")

    monkeypatch.setattr(server, "answer", fails)
    answer = Client(server).ask({"op": "hello"})  # rid 1
    assert answer["rid"] == 1 and not answer["ok"]
    assert answer["error"]["qualname"] == "FileNotFoundError"
    assert answer["error"]["message"] == "no such file: /data/\\udcff.pt"
    monkeypatch.undo()
    assert Client(server).ask({"op": "hello"})["ok"]  # and it answers the next


def test_a_replayed_request_is_refused_and_not_run_again(server):
    client = Client(server)
    define = {"op": "define", "define": [definition(Lin, nid="lin", i=3, o=3)]}
    assert client.ask(define)["ok"]
    node = server.sessions["s"].nodes["k"]
    load = client.seal.seal(
        wire.encode(
            {
                "op": "load",
                "rid": 9,
                "session": "s",
                "phase": "stage",
                "load": "l",
                "key": "k",
                "state": {"lin.bias": torch.ones(3)},
            }
        )
    )
    assert server.handle(load)[1]
    reply, verified = server.handle(load)  # the same bytes again
    assert verified is False and bytes(reply[2]) == b"replay"
    assert client.ask({"op": "load", "phase": "commit", "load": "l"})["ok"]
    assert torch.equal(node.lin.bias.detach(), torch.ones(3))


@pytest.mark.parametrize(
    "module, qualname",
    [
        ("os", "system"),
        ("somatize_never_imported", "Node"),
        ("torch", "save"),
        (__name__, "Client"),
    ],
)
def test_a_class_the_worker_was_not_told_to_build_is_refused_before_anything_is_imported(
    server, module, qualname
):
    d = {"key": "k", "id": "x", "module": module, "qualname": qualname, "args": {}}
    reply = Client(server).ask({"op": "define", "define": [d]})
    assert not reply["ok"] and reply["error"]["qualname"] == "PermissionError"
    assert "--import" in reply["error"]["message"] and "'x'" in reply["error"]["message"]
    assert "somatize_never_imported" not in sys.modules


def test_a_learning_may_name_an_optimizer_of_torch_and_nothing_else(server, tmp_path):
    from somatize.torch import Split

    target = tmp_path / "written"
    forged = definition(
        Split,
        nid="body/learning",
        optimizer=wire.Named("torch.serialization", "save"),
        f=str(target),
    )
    reply = Client(server).ask({"op": "define", "define": [forged]})
    assert (
        not reply["ok"]
        and "names torch.serialization.save, which this worker may not build"
        in reply["error"]["message"]
    )
    assert not target.exists()
    sgd = definition(Split, optimizer=torch.optim.SGD, lr=0.1)
    assert Client(server).ask({"op": "define", "define": [sgd]})["ok"]
    assert server.sessions["s"].nodes["k"].factory is torch.optim.SGD


def test_code_is_refused_by_a_worker_that_does_not_accept_it(server):
    d = {"key": "k", "id": "x", "code": b"\x80\x04."}
    reply = Client(server).ask({"op": "define", "define": [d]})
    assert not reply["ok"] and "--accept-code" in reply["error"]["message"]


def test_a_module_at_another_version_is_refused(server):
    d = {**definition(Lin), "version": "0.0.0-elsewhere"}
    reply = Client(server).ask({"op": "define", "define": [d]})
    assert not reply["ok"] and "install the same code" in reply["error"]["message"]


def test_weights_are_staged_then_committed_and_undone_on_demand(server):
    client = Client(server)
    client.ask({"op": "define", "define": [definition(Lin, nid="lin", i=3, o=3)]})
    node = server.sessions["s"].nodes["k"]
    before = node.lin.weight.detach().clone()
    stage = {"op": "load", "phase": "stage", "load": "l", "key": "k"}
    refused = client.ask({**stage, "state": {"lin.weight": torch.zeros(2, 2)}})
    assert not refused["ok"] and "nothing was loaded" in refused["error"]["message"]
    halves = {"lin.weight": torch.full((3, 3), 0.5, dtype=torch.float64)}  # cast on the way
    assert client.ask({**stage, "state": halves})["ok"]
    assert torch.equal(node.lin.weight.detach(), before)  # staged: nothing changed yet
    assert client.ask({"op": "load", "phase": "commit", "load": "l"})["ok"]
    assert torch.equal(node.lin.weight.detach(), torch.full((3, 3), 0.5))
    assert node.lin.weight.dtype == torch.float32
    assert client.ask({"op": "load", "phase": "undo", "load": "l"})["ok"]
    assert torch.equal(node.lin.weight.detach(), before)


def test_a_session_unused_for_its_timeout_or_whose_client_left_is_forgotten():
    server = Server(TOKEN, allowed=Allowed(["_remote_nodes"]), session_timeout=0.2)
    client = Client(server)
    client.ask({"op": "define", "define": [definition(Lin)]}, connection=7)
    assert server.expire() == []
    time.sleep(0.3)
    assert server.expire() == ["s"] and server.sessions == {}
    client.ask({"op": "define", "define": [definition(Lin)]}, connection=7)
    server.gone(7)
    time.sleep(0.3)
    assert server.expire() == ["s"]


def test_dropped_messages_are_logged_at_most_once_in_a_while(caplog):
    from somatize.remote.server import Drops

    drops = Drops(every=60.0)
    with caplog.at_level("WARNING", logger="somatize.worker"):
        for i in range(1000):
            drops.drop(f"junk {i}")
    assert drops.count == 1000
    assert [r.getMessage() for r in caplog.records] == ["dropped a message: junk 0"]
    drops.every = 0.0
    with caplog.at_level("WARNING", logger="somatize.worker"):
        drops.drop("junk again")
    assert (
        caplog.records[-1].getMessage()
        == "dropped a message: junk again (999 more since the last said)"
    )


def test_a_function_by_name_is_one_of_torch_nn_functional_or_of_an_imported_module(server):
    import os

    from _remote_nodes import Applies, negated

    client = Client(server)
    for fn, want in ((torch.nn.functional.relu, [0.0, 2.0]), (negated, [1.0, -2.0])):
        d = definition(Applies, nid="f", fn=fn)
        run = {
            "op": "run",
            "kept": "s1",
            "given": {},
            "input": torch.tensor([-1.0, 2.0]),
            "described": [[0, "k", "f", 0, None, None, "w", False, True]],
            "watching": False,
        }
        reply = client.ask({**run, "define": [d]})
        assert reply["ok"] and reply["value"]["out"][0].tolist() == want
    refused = client.ask({"op": "define", "define": [definition(Applies, nid="f", fn=os.system)]})
    assert not refused["ok"] and "names posix.system" in refused["error"]["message"]


def test_a_kept_slice_runs_by_its_key_and_a_malformed_or_unknown_one_is_refused(server):
    client = Client(server)
    step = [0, "k", "lin", 0, None, None, "w", False, True]
    run = {"op": "run", "kept": "s1", "given": {}, "input": torch.ones(3)}
    define = [definition(Lin, nid="lin", i=3, o=3)]
    first = client.ask({**run, "described": [step], "define": define})
    again = client.ask(run)  # the worker built it once and kept it: the key and the values
    assert first["ok"] and torch.equal(again["value"]["out"][0], first["value"]["out"][0])
    for bad, said in (
        ({"kept": ["s1"]}, "kept under a str key"),
        ({"described": [step[:8]]}, "nine fields"),
        ({"described": [[*step[:3], 7, *step[4:]]]}, "unknown step mode 7"),
    ):
        refused = client.ask({**run, **bad})
        assert not refused["ok"] and said in refused["error"]["message"]
    unknown = client.ask({**run, "kept": "s2"})
    assert unknown["error"]["qualname"] == "Unknown"
    assert "forward slice 's2'" in unknown["error"]["message"]
