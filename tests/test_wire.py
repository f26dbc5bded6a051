"""The wire's encoding and its seal, in this process: what crosses, what comes back, and what
hostile bytes get (a clear error, never a crash, nothing imported or run)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq
from _children import tuples
from _sealed import sealed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize import Broker, Graph, NoCodec, Node, Worker
from somatize.codecs import DEPTH, codec, decode, encode
from somatize.remote import seal, wire

KEY = bytes(range(32))


def received(frames):
    """What a receiving socket hands over: zmq Frames, not the objects that were sent."""
    return [zmq.Frame(bytes(memoryview(f))) for f in frames]


def test_plain_values_keep_their_types():
    value = {"a": (1, 2, (3,)), "b": [True, None, 2**100, -(2**70)], "c": {1: b"x"}, "d": 1.5}
    back = wire.decode(received(wire.encode(value)))
    assert back == value
    assert type(back["a"]) is tuple and type(back["a"][2]) is tuple
    assert type(back["b"][0]) is bool and type(back["c"][1]) is bytes


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 4),
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.randn(5, 6).t(),  # not contiguous
        torch.arange(10, dtype=torch.int64),
        torch.tensor([True, False]),
        torch.randn(4, 4).to(torch.bfloat16),
        torch.randn(4, 3, dtype=torch.complex64).conj(),
        torch.randn(300, 300, dtype=torch.float64),
    ],
    ids=["f32", "0-dim", "empty", "transposed", "i64", "bool", "bf16", "conj", "large f64"],
)
def test_tensors_come_back_equal_each_as_its_own_frame(t):
    frames = wire.encode({"x": [t, (t,)]})
    assert len(frames) == 3  # the header, then one frame per tensor
    back = wire.decode(received(frames))
    want = t.resolve_conj()
    for got in (back["x"][0], back["x"][1][0]):
        assert got.dtype == t.dtype and got.shape == t.shape and not got.is_conj()
        assert torch.equal(got, want)


def test_a_tensor_goes_from_its_own_memory_and_comes_back_on_the_frame():
    t = torch.randn(512, 512)
    frames = wire.encode(t)
    assert isinstance(frames[1], np.ndarray) and frames[1].ctypes.data == t.data_ptr()
    got = received(frames)
    back = wire.decode(got)
    back += 1  # writable, and the frame's own memory: the frame sees it
    assert torch.equal(torch.frombuffer(got[1].buffer, dtype=torch.float32).view(512, 512), back)
    assert torch.allclose(back, t + 1)


def test_a_tensor_that_asks_for_a_gradient_still_does_after_crossing():
    t = torch.randn(3, requires_grad=True) * 2
    back = wire.decode(received(wire.encode([t, t.detach()])))
    assert back[0].requires_grad and back[0].is_leaf and not back[1].requires_grad
    assert torch.equal(back[0].detach(), t.detach())


def test_tensors_without_plain_numbers_are_refused():
    for t, said in ((torch.eye(3).to_sparse(), "sparse"), (torch.empty(2, device="meta"), "meta")):
        with pytest.raises(TypeError, match=said):
            wire.encode({"x": t})


def test_a_class_crosses_by_name_and_is_never_imported_on_arrival():
    back = wire.decode(received(wire.encode({"opt": torch.optim.SGD, "f": os.system})))
    assert back["opt"] == wire.Named("torch.optim.sgd", "SGD")
    assert back["f"] == wire.Named("posix", "system") and not callable(back["f"])
    forged = msgpack.packb(msgpack.ExtType(4, msgpack.packb(["somatize_never_imported", "x"])))
    assert wire.decode([forged]) == wire.Named("somatize_never_imported", "x")
    assert "somatize_never_imported" not in sys.modules
    with pytest.raises(NoCodec, match="inside a function"):
        wire.encode({"f": lambda x: x})


def test_a_value_without_a_codec_is_refused_naming_where():
    class Thing:
        pass

    with pytest.raises(NoCodec, match="Thing.*in node 'enc'"):
        wire.encode({"v": [Thing()]}, where="node 'enc'")


def _ref(frame, dtype, shape, grad=False):
    return msgpack.ExtType(3, msgpack.packb([frame, dtype, shape, grad]))


@pytest.mark.parametrize(
    "header, data, said",
    [
        (_ref(1, "float32", [9]), [b"1234"], "holds 36 bytes, not 4"),
        (_ref(2, "float32", [1]), [b"1234"], "names frame 2"),
        (_ref(0, "float32", [1]), [b"1234"], "names frame 0"),
        ([_ref(1, "uint8", [4]), _ref(1, "uint8", [4])], [b"1234"], "one taken"),
        (_ref(1, "uint8", [4]), [b"1234", b"5678"], "no tensor names"),
        (_ref(1, "object", [4]), [b"1234"], "does not cross"),
        (_ref(1, "uint8", [-4]), [b"1234"], "sizes >= 0"),
        (_ref(1, "int8", [4], True), [b"1234"], "cannot ask for a gradient"),
        (msgpack.ExtType(9, b""), [], "extension type 9"),
        (msgpack.ExtType(1, msgpack.packb(5)), [], "holds no items"),
    ],
)
def test_frames_that_do_not_add_up_are_malformed(header, data, said):
    with pytest.raises(wire.Malformed, match=said):
        wire.decode([msgpack.packb(header), *data])


def _value(inner):
    """A value extension, as `codecs.encode` writes one, holding `inner`."""
    return msgpack.ExtType(5, msgpack.packb(inner, unicode_errors="surrogatepass"))


@pytest.mark.parametrize(
    "header",
    [
        {"op": "hello", "rid": _value("\udcff")},
        {"op": "define", "define": [{"module": _value("mod\ud800ule")}]},
        _value(("fine", ["deeper", {"key": "\udfff"}])),
        _value({"\udcff": 1}),
        b"\x81\xa2op\xa1\xff",  # a str whose byte is no UTF-8 at all
    ],
)
def test_text_that_is_not_utf8_is_malformed_wherever_it_hides(header):
    packed = header if type(header) is bytes else msgpack.packb(header)
    with pytest.raises(wire.Malformed, match="UTF-8|utf-8"):
        wire.decode([packed])
    fine = {"rid": _value("naïve ✓"), "t": _value(["é", {"ü": ["☃"]}])}
    assert wire.decode([msgpack.packb(fine)]) == {"rid": "naïve ✓", "t": ["é", {"ü": ["☃"]}]}


def test_too_many_frames_and_too_deep_a_nesting_are_malformed():
    with pytest.raises(wire.Malformed, match="frames"):
        wire.decode([msgpack.packb(None)] * (wire.MOST_FRAMES + 1))
    with pytest.raises(wire.Malformed, match=f"nested more than {DEPTH} deep"):
        wire.decode([tuples(DEPTH + 1)])  # what encode refuses to write, sent by hand
    assert wire.decode([tuples(DEPTH)]) == tuples_of(DEPTH)  # as deep as allowed: fine
    for hostile in (b"\x91" * 5000 + b"\xc0", msgpack.packb(msgpack.ExtType(1, b"\x91" * 5000))):
        with pytest.raises(wire.Malformed, match="lists or dicts nested more than 1024 deep"):
            wire.decode([hostile])  # said as codecs.decode says it


def tuples_of(depth, leaf=None):
    """`leaf` inside `depth` tuples."""
    for _ in range(depth):
        leaf = (leaf,)
    return leaf


def lists_of(depth, leaf=0):
    """`leaf` inside `depth` lists."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


class Boxed:
    """A registered value (by codecs.encode inside the wire): a level of nesting of its own."""

    def __init__(self, inside):
        self.inside = inside


codec("test-wire-boxed", Boxed, dump=lambda b: encode(b.inside), load=lambda d: Boxed(decode(d)))


@pytest.mark.parametrize(
    "value, frames",
    [
        (tuples_of(DEPTH), 1),
        (tuples_of(DEPTH + 1), None),
        (tuples_of(DEPTH - 1, torch.ones(2)), 2),  # a tensor's head is one level more
        (tuples_of(DEPTH, torch.ones(2)), None),
        (tuples_of(15, Boxed(tuples_of(15))), 1),  # the wire's levels and the codec's, added
        (tuples_of(20, Boxed(tuples_of(20))), None),
        (lists_of(1024, 0), 1),
        (lists_of(1025, 0), None),
        (lists_of(1023, []), 1),  # an empty list is a level too: 1024 of them
        (lists_of(1024, []), None),  # 1025, which msgpack writes and will not read
        (lists_of(1023, {}), 1),
        (lists_of(1024, {}), None),
        ((lists_of(1022, []),), 1),  # a tuple's items are one list: 1024 again
        ((lists_of(1023, []),), None),
        # a tensor 1025 levels down, another before it: one frame each, though msgpack is
        # asked twice (1025 levels down, something might be a list it would not read)
        ({"t": torch.ones(2), "x": lists_of(1023, torch.ones(3))}, 3),
    ],
    ids=(
        "tuples tuples+1 tensor tensor+1 boxed boxed+ lists lists+1 empty-list empty-list+1 "
        "empty-dict empty-dict+1 tuple tuple+1 tensor-in-lists"
    ).split(),
)
def test_what_the_wire_writes_it_reads_back_and_what_it_would_not_read_it_refuses(value, frames):
    if frames is None:
        with pytest.raises(ValueError, match="deep.*flatten") as refused:
            wire.encode(value)
        assert not isinstance(refused.value, wire.Malformed)  # the sender's, before sending
        return
    sent = wire.encode(value)
    assert len(sent) == frames
    back = wire.decode(received(sent))
    assert wire.encode(back)[0] == sent[0]  # == on values this deep passes Python's limit


@pytest.mark.parametrize(
    "value",
    [tuples_of(DEPTH + 1), {"a": lists_of(2000)}, lists_of(1024, []), (lists_of(1023, {}),)],
    ids="tuples lists empty-list tuple".split(),
)
def test_the_wire_says_whose_value_nested_too_deep_as_a_store_does(value):
    with pytest.raises(ValueError) as kept:
        encode(value, where="node 'deep'")
    with pytest.raises(ValueError) as sent:
        wire.encode(value, where="node 'deep'")
    assert str(sent.value) == str(kept.value)
    assert str(sent.value).startswith("node 'deep': ") and "flatten" in str(sent.value)


class Recursing:
    """A registered value whose codec's own refusal speaks of a recursion limit."""


dumped = []


def refuse_recursing(value):
    dumped.append(value)
    raise ValueError("recursion limit exceeded in its own format")


codec("test-wire-recursing", Recursing, dump=refuse_recursing, load=lambda d: Recursing())


def test_a_codecs_own_error_is_its_own_on_the_wire_not_a_nesting_bound():
    dumped.clear()
    message = {"x": [1, Recursing()]}
    with pytest.raises(ValueError, match="codec 'test-wire-recursing' cannot write down the Rec"):
        wire.encode(message, where="node 'r'")
    assert len(dumped) == 1  # asked once, as a store asks it


class Nests(Node):
    """Hands back what it was given inside `depth` tuples, or lists when `lists`."""

    def __init__(self, depth, lists=False):
        self.depth, self.lists = depth, lists

    def forward(self, x, ctx):
        for _ in range(self.depth):
            x = [x] if self.lists else (x,)
        return x


def test_a_worker_answer_nested_too_deep_is_a_value_error_naming_its_node():
    with Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")}) as b:
        for node, said in ((Nests(DEPTH + 1), f"tuples.*{DEPTH}"), (Nests(1025, True), "lists")):
            g = Graph.somatize(node.named("deep").at("w"))
            with pytest.raises(ValueError, match=f"^the output of node 'deep': {said}.*flatten"):
                g.forward(0, broker=b)
        assert Graph.somatize(Nests(DEPTH).named("fine").at("w")).forward(0, broker=b) == (
            tuples_of(DEPTH, 0)
        )


def test_a_worker_answers_hostile_nesting_with_the_bound_and_serves_the_next_call():
    worker = Worker.spawn(["--threads", "1"])
    sock, sealer = sealed(worker)
    try:
        hostile = {
            f"more than {DEPTH} deep": tuples(200),
            "more than 1024 deep": b"\x91" * 5000 + b"\xc0",
            "lists or dicts nested more than 1024": msgpack.packb(
                msgpack.ExtType(1, b"\x91" * 5000)
            ),
        }
        for said, data in hostile.items():
            header = b"\x83" + b"".join(map(msgpack.packb, ["op", "hello", "rid", 7, "x"])) + data
            sock.send_multipart(sealer.seal([header]))
            answer = wire.decode(sealer.open(sock.recv_multipart()))  # within 15 s
            assert answer["ok"] is False and answer["error"]["qualname"] == "Malformed"
            assert said in answer["error"]["message"], answer["error"]["message"]
        with Broker.embedded({"w": Worker.at(worker.address, token=worker.token)}) as b:
            before = b.request("w", {"op": "hello"}, deadline=15)
            assert before["pid"] == worker.pid
            with pytest.raises(ValueError, match="cannot be written down"):  # refused here
                b.request("w", {"op": "hello", "x": tuples_of(DEPTH + 1)}, deadline=15)
            after = b.request("w", {"op": "hello"}, deadline=15)
            assert after["served"] == before["served"] + 1  # the refused one never reached it
    finally:
        sock.close(0)
        worker.stop()


def test_a_hostile_nesting_is_an_error_and_the_process_lives():
    # tuples nested 195 deep in 900 bytes: what crashed a decoder once. In a child process,
    # so that a crash is a failed test, not a dead test run.
    code = textwrap.dedent(
        """
        from _children import tuples
        from somatize.remote import wire
        for frames in ([tuples(195)], [bytes([0x91]) * 5000 + bytes([0xC0])]):
            try:
                wire.decode(frames)
            except wire.Malformed as e:
                print("malformed", "32 deep" in str(e), "1024 deep" in str(e))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["malformed", "True", "False", "malformed", "False", "True"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=80), min_size=1, max_size=4))
def test_random_bytes_are_malformed_never_a_crash(frames):
    try:
        wire.decode(frames)
    except (wire.Malformed, NoCodec):
        pass


# -- the seal ---------------------------------------------------------------------------------


def test_a_sealed_message_opens_to_its_frames_and_a_change_anywhere_is_refused():
    s = seal.Seal(KEY)
    frames = [bytes(memoryview(f)) for f in wire.encode({"op": "run", "x": torch.ones(300)})]
    sealed = [bytes(memoryview(f)) for f in s.seal(frames)]
    assert seal.Seal(KEY).open(sealed) == frames
    for frame in range(len(sealed)):
        for at in (0, -1):
            changed = list(sealed)
            b = bytearray(changed[frame])
            b[at] ^= 1
            changed[frame] = bytes(b)
            with pytest.raises(seal.Refused):
                seal.Seal(KEY).open(changed)
    recut = [sealed[0], sealed[1] + sealed[2][:1], sealed[2][1:]]
    # the zeros the tag pads a frame with, sent: refused because every length is in the tag
    # (what keeps the padding unambiguous; the padding itself is a matter of speed)
    padded = [*sealed[:2], sealed[2] + b"\0"]
    for wrong in (recut, sealed[:2], [*sealed, b""], padded):
        with pytest.raises(seal.Refused):
            seal.Seal(KEY).open(wrong)
    with pytest.raises(seal.Refused, match="does not verify"):
        seal.Seal(bytes(32)).open(sealed)
    assert s.seal(frames)[0] != s.seal(frames)[0]  # a fresh nonce every time


def test_a_replay_is_refused_and_so_is_a_message_sealed_too_long_ago():
    sender, receiver = seal.Seal(KEY), seal.Seal(KEY)
    message = sender.seal([b"load"])
    assert receiver.open(message) == [b"load"]
    with pytest.raises(seal.Refused) as replay:
        receiver.open(message)
    assert replay.value.reason == "replay"
    late = seal.Seal(KEY, offset=-2 * seal.WINDOW).seal([b"step"])
    with pytest.raises(seal.Refused) as stale:
        receiver.open(late)
    assert stale.value.reason == "stale"


def test_the_nonces_remembered_are_bounded_and_what_was_forgotten_is_still_refused(monkeypatch):
    monkeypatch.setattr(seal, "REMEMBERED", 64)
    sender, receiver = seal.Seal(KEY), seal.Seal(KEY)
    first = sender.seal([b"0"])
    receiver.open(first)
    time.sleep(0.01)  # so that the first is strictly older than what comes after
    later = [sender.seal([str(i).encode()]) for i in range(200)]
    for message in later:
        receiver.open(message)
    assert len(receiver.seen) <= 64
    for message in (first, later[0], later[-1]):  # forgotten or remembered: refused alike
        with pytest.raises(seal.Refused):
            receiver.open(message)


def test_the_key_is_scrypt_of_the_token_under_the_workers_salt():
    salt = os.urandom(16)
    key = seal.derive("a typed token", salt)
    want = hashlib.scrypt(b"a typed token", salt=salt, n=1 << 14, r=8, p=1, dklen=32)
    assert key == want and seal.derive("a typed token", os.urandom(16)) != key
