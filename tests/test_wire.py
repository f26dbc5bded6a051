"""The wire: signed frames, tensors without copies, and what a worker does with bad bytes."""

from __future__ import annotations

import json
import os

import msgpack
import pytest
import safetensors.torch
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize import NoCodec
from somatize.remote import wire
from somatize.remote.server import Server

TOKEN = "t" * 64


def as_frames(frames):
    """What a receiving socket hands over: zmq Frames, not the objects that were sent."""
    return [zmq.Frame(bytes(memoryview(f))) for f in frames]


def test_plain_values_keep_their_types():
    value = {"a": (1, 2, (3,)), "b": [True, None, 2**100], "c": {1: b"x"}, "d": 1.5}
    back = wire.unpack(TOKEN, wire.pack(TOKEN, value))
    assert back == value
    assert type(back["a"]) is tuple and type(back["a"][2]) is tuple
    assert type(back["b"][0]) is bool


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
        torch.randn(300, 300),  # above the zero-copy threshold
    ],
    ids=["f32", "0-dim", "empty", "transposed", "i64", "bool", "bf16", "large"],
)
def test_tensors_come_back_equal(t):
    back = wire.unpack(TOKEN, as_frames(wire.pack(TOKEN, {"x": [t, (t,)]})))
    for got in (back["x"][0], back["x"][1][0]):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t)


def test_a_large_tensor_is_sent_from_its_memory_and_built_on_the_frame():
    t = torch.randn(512, 512)
    frames = wire.pack(TOKEN, t)
    assert len(frames) == 2  # the sealed header, then the tensor's own frame
    data = frames[1]
    assert memoryview(data).nbytes == t.numel() * 4
    import numpy as np

    assert isinstance(data, np.ndarray) and data.ctypes.data == t.data_ptr()  # no copy sent
    received = as_frames(frames)
    back = wire.unpack(TOKEN, received)
    assert back.data_ptr() == _address(received[1])  # no copy received
    back += 1  # a received tensor is writable
    assert torch.allclose(back, t + 1)


def _address(frame):
    import ctypes

    view = frame.buffer
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _reference(frames, at=0):
    """The `at`-th tensor reference in a message's header: [data or frame, head, grad]."""
    refs = []
    msgpack.unpackb(
        frames[0][wire._SEAL :], ext_hook=lambda code, data: refs.append(msgpack.unpackb(data))
    )
    return refs[at]


@pytest.mark.parametrize("size", [(7, 3), (300, 300)], ids=["inline", "own frame"])
def test_a_tensor_reference_and_its_bytes_are_a_safetensors_file(size):
    t = torch.randn(*size)
    frames = wire.pack(TOKEN, t)
    where, head, grad = _reference(frames)
    data = where if isinstance(where, bytes) else bytes(memoryview(frames[where]))
    assert isinstance(where, bytes) == (t.nbytes < 1 << 16) and len(frames) == 1 + (
        t.nbytes >= 1 << 16
    )
    header = json.dumps({"tensor": json.loads(head)}).encode()
    file = len(header).to_bytes(8, "little") + header + data
    assert torch.equal(safetensors.torch.load(file)["tensor"], t)


@pytest.mark.parametrize("n", [3, 4000], ids=["tiny: BLAKE2b", "small: Poly1305"])
def test_a_wrong_token_or_a_changed_byte_is_refused(n):
    frames = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"op": "hello", "x": torch.ones(n)})]
    with pytest.raises(wire.Refused):
        wire.unpack("another token", frames)
    for at in (-1, wire._SEAL, 5, 21):  # the tensor's bytes, the header, the nonce, the tag
        changed = bytearray(frames[0])
        changed[at] ^= 1
        with pytest.raises(wire.Refused):
            wire.unpack(TOKEN, [bytes(changed)])
    big = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"x": torch.ones(300, 300)})]
    recut = [big[0] + big[1][:1], big[1][1:]]  # frames re-cut
    with pytest.raises(wire.Refused):
        wire.unpack(TOKEN, recut)


def test_not_a_message_is_malformed():
    for frames in (
        [],
        [b"SMZ1"],
        [b"XXXX" + b"0" * 32 + b"h"],
        [wire.MAGIC + b"short", b"h"],
        [b""],
    ):
        with pytest.raises(wire.Malformed):
            wire.unpack(TOKEN, frames)


def test_signed_nonsense_is_malformed_not_a_crash():
    header = msgpack.packb(
        msgpack.ExtType(64, msgpack.packb([0, '{"dtype":"F32","shape":[9]', False]))
    )
    frames = wire.sealed(TOKEN, [header, b"1234"])
    with pytest.raises(wire.Malformed):
        wire.unpack(TOKEN, frames)
    lying = msgpack.packb(
        msgpack.ExtType(
            64, msgpack.packb([1, '{"dtype":"F32","shape":[9],"data_offsets":[0,36]}', False])
        )
    )
    frames = wire.sealed(TOKEN, [lying, b"1234"])
    with pytest.raises(wire.Malformed, match="does not fit"):
        wire.unpack(TOKEN, frames)
    inline = msgpack.packb(
        msgpack.ExtType(
            64, msgpack.packb([b"1234", '{"dtype":"F32","shape":[9],"data_offsets":[0,36]}', False])
        )
    )
    with pytest.raises(wire.Malformed, match="does not fit"):
        wire.unpack(TOKEN, wire.sealed(TOKEN, [inline]))
    for where in (0, 2, -1, "x"):  # a frame that is not there, or no data at all
        nowhere = msgpack.packb(
            msgpack.ExtType(
                64, msgpack.packb([where, '{"dtype":"U8","shape":[4],"data_offsets":[0,4]}', False])
            )
        )
        with pytest.raises(wire.Malformed):
            wire.unpack(TOKEN, wire.sealed(TOKEN, [nowhere, b"1234"]))


def test_a_value_without_a_codec_is_refused_naming_where():
    class Thing:
        pass

    with pytest.raises(NoCodec, match="Thing.*in node 'enc'"):
        wire.pack(TOKEN, {"v": [Thing()]}, where="node 'enc'")


def test_the_server_drops_unsigned_and_answers_signed():
    server = Server(TOKEN)
    assert server.handle([b"junk"]) is None
    assert server.handle(wire.pack("wrong", {"op": "hello", "rid": 1})) == [wire.REFUSED]
    assert server.dropped == 2
    reply = wire.unpack(
        TOKEN, as_frames(server.handle(wire.pack(TOKEN, {"op": "hello", "rid": 7})))
    )
    assert reply["ok"] and reply["rid"] == 7 and reply["value"]["pid"] == os.getpid()
    bad = wire.unpack(TOKEN, as_frames(server.handle(wire.pack(TOKEN, {"op": "nope", "rid": 8}))))
    assert not bad["ok"] and "unknown request 'nope'" in bad["error"]["message"]


def test_the_server_refuses_to_import_what_is_not_a_node():
    server = Server(TOKEN)
    define = {"key": "k", "id": "x", "module": "os", "qualname": "system", "args": {}}
    request = {"op": "define", "rid": 1, "session": "s", "define": [define]}
    reply = wire.unpack(TOKEN, as_frames(server.handle(wire.pack(TOKEN, request))))
    assert not reply["ok"] and "not a somatize Node class" in reply["error"]["message"]
    pickled = {**define, "pickled": b"\x80\x04."}
    request = {"op": "define", "rid": 2, "session": "s", "define": [pickled]}
    reply = wire.unpack(TOKEN, as_frames(server.handle(wire.pack(TOKEN, request))))
    assert not reply["ok"] and "--accept-code" in reply["error"]["message"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=5), st.integers(0, 200))
def test_random_and_truncated_bytes_never_crash_the_server(frames, cut):
    server = Server(TOKEN)
    assert server.handle(frames) in (None, [wire.REFUSED])
    real = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"op": "hello", "x": torch.ones(4)})]
    truncated = list(real)
    truncated[-1] = truncated[-1][: cut % len(truncated[-1])]
    assert server.handle(truncated) in (None, [wire.REFUSED])
    big = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"op": "hello", "x": torch.ones(20000)})]
    assert server.handle(big[: cut % 2]) in (None, [wire.REFUSED])  # a frame missing
    assert server.handle([big[0], big[1][: cut % len(big[1])]]) in (None, [wire.REFUSED])
    signed = frames or [b""]  # signed with the right token, and still nonsense
    answer = server.handle(wire.sealed(TOKEN, signed))
    assert answer is None or wire.unpack(TOKEN, as_frames(answer))["ok"] is False


def test_a_tensor_that_asks_for_a_gradient_still_does_after_crossing():
    t = torch.randn(3, requires_grad=True) * 2
    back = wire.unpack(TOKEN, as_frames(wire.pack(TOKEN, [t, t.detach()])))
    assert back[0].requires_grad and back[0].is_leaf and not back[1].requires_grad
    assert torch.equal(back[0].detach(), t.detach())


def test_views_are_sent_as_their_numbers_and_tensors_without_plain_numbers_are_refused():
    c = torch.randn(4, 3, dtype=torch.complex64)
    large = torch.randn(300, 200)
    for t in (c.conj(), c._neg_view(), large.t(), large[:, ::2]):
        back = wire.unpack(TOKEN, as_frames(wire.pack(TOKEN, {"x": t})))["x"]
        assert back.is_contiguous() and not back.is_conj() and not back.is_neg()
        assert torch.equal(back, t.resolve_conj().resolve_neg())
    for t, said in ((torch.eye(3).to_sparse(), "sparse"), (torch.empty(2, device="meta"), "meta")):
        with pytest.raises(TypeError, match=said):
            wire.pack(TOKEN, {"x": t})


def test_torch_classes_cross_by_name_and_nothing_else_does():
    back = wire.unpack(TOKEN, as_frames(wire.pack(TOKEN, {"opt": torch.optim.SGD})))
    assert back["opt"] is torch.optim.SGD
    with pytest.raises(NoCodec):
        wire.pack(TOKEN, {"f": os.system})
    forged = msgpack.packb(msgpack.ExtType(65, msgpack.packb(["os", "system"])))
    frames = wire.sealed(TOKEN, [forged])
    with pytest.raises(wire.Malformed, match="outside"):
        wire.unpack(TOKEN, frames)


def test_a_seal_is_fresh_per_message_and_binds_every_frame_of_a_large_message():
    t = torch.randn(256, 256)  # above the zero-copy threshold: its frame is the tensor's memory
    frames = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"op": "run", "x": t})]
    again = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"op": "run", "x": t})]
    seal, s = slice(4, wire._SEAL), wire._SEAL
    assert frames[0][seal] != again[0][seal]  # a new nonce, so a new key
    assert frames[0][s:] == again[0][s:] and frames[1:] == again[1:]
    assert torch.equal(wire.unpack(TOKEN, frames)["x"], t)
    tampered = bytearray(frames[1])
    tampered[len(tampered) // 2] ^= 0x80  # one bit in the middle of the tensor's bytes
    header = frames[0][s:]
    cases = {
        "a flipped bit in the data": frames[:1] + [bytes(tampered)],
        "the seal of another message": [again[0][:s] + header, bytes(tampered)],
        "a nonce moved to another tag": [again[0][:20] + frames[0][20:], *frames[1:]],
        "a frame dropped": frames[:1],
        "a frame added": [*frames, b""],
        "the tag of the bytes, under another token": wire.sealed(
            "another token", [header, *frames[1:]]
        ),
    }
    for why, changed in cases.items():
        with pytest.raises((wire.Refused, wire.Malformed)):
            wire.unpack(TOKEN, changed)
            pytest.fail(f"accepted {why}")


def test_a_frame_of_several_pieces_is_bound_piece_by_piece_and_in_order():
    t = torch.randn(5 * wire._PIECE // 8)  # 2.5 pieces: GMACed on threads, each its own nonce
    frames = [bytes(memoryview(f)) for f in wire.pack(TOKEN, {"x": t})]
    assert torch.equal(wire.unpack(TOKEN, frames)["x"], t)
    data = frames[1]
    swapped = data[wire._PIECE : 2 * wire._PIECE] + data[: wire._PIECE] + data[2 * wire._PIECE :]
    for at in (0, wire._PIECE + 7, len(data) - 1):  # a bit in each piece
        changed = bytearray(data)
        changed[at] ^= 1
        with pytest.raises(wire.Refused):
            wire.unpack(TOKEN, [frames[0], bytes(changed)])
    with pytest.raises(wire.Refused):
        wire.unpack(TOKEN, [frames[0], swapped])


FORKED = """
import os, torch
torch.set_num_threads(1)  # (torch's own OpenMP threads do not survive a fork either)
from somatize.remote import wire
t = torch.randn(5 << 20)  # several GMAC pieces: hashed on the pool's threads
frames = [bytes(memoryview(f)) for f in wire.pack("k", {"x": t})]
assert torch.equal(wire.unpack("k", frames)["x"], t)
pid = os.fork()
if pid == 0:  # the parent's pool threads do not exist here: a new pool is made
    os._exit(0 if torch.equal(wire.unpack("k", frames)["x"], t) else 1)
print(os.waitpid(pid, 0)[1])
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_checks_large_frames_on_threads_of_its_own():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_the_server_drops_a_tampered_data_frame_runs_nothing_and_goes_on():
    server = Server(TOKEN)
    request = {"op": "define", "rid": 1, "session": "s", "define": [], "x": torch.randn(300, 300)}
    frames = [bytes(memoryview(f)) for f in wire.pack(TOKEN, request)]
    tampered = bytearray(frames[1])
    tampered[-1] ^= 1
    assert server.handle(frames[:1] + [bytes(tampered)]) == [wire.REFUSED]
    assert server.dropped == 1 and server.served == 0 and "s" not in server.sessions
    reply = wire.unpack(TOKEN, as_frames(server.handle(as_frames(frames))))
    assert reply["ok"] and reply["rid"] == 1 and server.served == 1


KEPT = """
import resource, sys, zmq
from somatize.remote.memory import keep_buffers
print(keep_buffers())
ctx = zmq.Context()
a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
port = a.bind_to_random_port("tcp://127.0.0.1")
b.connect(f"tcp://127.0.0.1:{port}")
data = bytearray(64 << 20)
faults = []
for _ in range(4):
    a.send(data, copy=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b.recv(copy=False)  # dropped at once: its buffer is free for the next message
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def _kept(env_value):
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("SOMATIZE_KEEP_BUFFERS", None)
    if env_value is not None:
        env["SOMATIZE_KEEP_BUFFERS"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", KEPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    took, faults = out.stdout.split("\n")[:2]
    return took == "True", json.loads(faults)


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="glibc's malloc only")
def test_a_large_message_lands_in_memory_already_mapped():
    took, faults = _kept(None)
    assert took
    assert max(faults[2:]) < 1000, faults  # 64 MB fresh would be 16,384 page faults
    took, faults = _kept("0")  # left alone: every receive is a fresh mapping
    assert not took
    assert min(faults[2:]) > 8000, faults


# -- the fixed record: a repeated run and its plain answer ---------------------------------


def _run(given=None, input=None, **changed):
    """A run request as the broker sends it for a slice the worker holds already."""
    message = {
        "op": "run",
        "define": [],
        "sid": "s12",
        "slice": None,
        "given": given or {},
        "input": input,
        "timed": False,
        "session": "0123abcd",
        "rid": 77,
    }
    return {**message, **changed}


def _answer(out, **changed):
    message = {"rid": 78, "ok": True, "worker": "feed", "value": {"out": out, "ran": []}}
    return {**message, **changed}


def _is_record(frames):
    return bytes(memoryview(frames[0]))[wire._SEAL] == wire._RECORD


def _same(a, b):
    """Equal messages, tensors compared by value, dtype, shape and whether they ask for a
    gradient."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_a_repeated_run_and_its_answer_go_as_a_record_and_come_back_the_same():
    big = torch.randn(300, 300)  # its own frame, sent from its memory
    cases = [
        _run(input=torch.randn(256)),
        _run(given={3: torch.randn(2, 3, 4), 0: torch.arange(5)}, input=None),
        _run(given={1: torch.randn(4, requires_grad=True) * 2}, input=big),
        _run(given={2: torch.tensor(True), 4: torch.zeros(0, 3)}, input=torch.tensor(2.5)),
        _run(input=torch.randn(3, 8).t()),  # a view: its numbers in C order
        _answer({5: torch.randn(16, dtype=torch.float64)}),
        _answer({0: big, 9: torch.ones(3, dtype=torch.int8)}),
        _answer({}),
    ]
    for message in cases:
        frames = wire.pack(TOKEN, message)
        assert _is_record(frames), message
        back = wire.unpack(TOKEN, as_frames(frames))
        assert _same(message, back), (message, back)
    frames = wire.pack(TOKEN, _run(input=big))
    assert len(frames) == 2 and frames[1].ctypes.data == big.data_ptr()  # no copy sent


@pytest.mark.parametrize(
    "message",
    [
        _run(input=torch.randn(3), timed=True),  # per-node times: msgpack
        _run(input=torch.randn(3), define=[{"key": "k"}]),
        _run(input=torch.randn(3), slice=[[0, "k", "a", 0, None, None, "h", False, True]]),
        _run(input=1.5),  # not a tensor
        _run(given={0: [torch.randn(2)]}),
        _run(input=torch.randn(3, dtype=torch.bfloat16)),  # numpy has no bfloat16
        _run(input=torch.randn(300, 300).t()),  # large and not contiguous
        _run(input=torch.nn.Parameter(torch.randn(3))),  # a subclass
        _run(input=torch.randn(3), session="é"),  # not ascii
        _run(input=torch.randn(3), extra=1),  # another key
        _answer({0: torch.randn(2)}, ok=False),
        _answer({0: "text"}),
        {**_answer({0: torch.randn(2)}), "value": {"out": {}, "ran": [["n", 0.0, 1.0]]}},
    ],
    ids=lambda m: "",
)
def test_anything_else_goes_as_msgpack_and_still_comes_back(message):
    frames = wire.pack(TOKEN, message)
    assert not _is_record(frames)
    back = wire.unpack(TOKEN, as_frames(frames))
    assert back.keys() == message.keys() and back.get("rid") == message.get("rid")


def test_a_record_tensor_and_its_bytes_are_a_safetensors_file():
    t = torch.randn(7, 3)
    header = bytes(memoryview(wire.pack(TOKEN, _run(input=t))[0]))[wire._SEAL :]
    at = wire._REC.size + 1 + len("0123abcd") + 1 + len("s12")
    slot, grad, frame, length = wire._ENTRY.unpack_from(header, at)
    at += wire._ENTRY.size
    head = header[at : at + length]
    data = header[at + length :]
    assert (slot, grad, frame) == (-1, 0, 0) and len(data) == t.nbytes
    file_header = json.dumps({"tensor": json.loads(head)}).encode()
    file = len(file_header).to_bytes(8, "little") + file_header + data
    assert torch.equal(safetensors.torch.load(file)["tensor"], t)


def test_a_changed_cut_or_resealed_record_is_refused_or_malformed():
    frames = [bytes(memoryview(f)) for f in wire.pack(TOKEN, _run(input=torch.randn(256)))]
    assert _is_record(frames)
    with pytest.raises(wire.Refused):
        wire.unpack("another token", frames)
    for at in (wire._SEAL, wire._SEAL + 5, -1, 5, 21):  # marker, rid, a number, nonce, tag
        changed = bytearray(frames[0])
        changed[at] ^= 1
        with pytest.raises(wire.Refused):
            wire.unpack(TOKEN, [bytes(changed)])
    with pytest.raises((wire.Refused, wire.Malformed)):
        wire.unpack(TOKEN, [frames[0][:-1]])
    header = frames[0][wire._SEAL :]
    for bad in (header[:-1], header + b"\0", header[:12], header[:1]):  # signed, and wrong
        with pytest.raises(wire.Malformed):
            wire.unpack(TOKEN, wire.sealed(TOKEN, [bad]))
    big = [bytes(memoryview(f)) for f in wire.pack(TOKEN, _run(input=torch.randn(300, 300)))]
    with pytest.raises(wire.Malformed, match="names data frame"):  # its frame dropped
        wire.unpack(TOKEN, wire.sealed(TOKEN, [big[0][wire._SEAL :]]))
    with pytest.raises(wire.Malformed, match="does not fit"):  # another frame in its place
        wire.unpack(TOKEN, wire.sealed(TOKEN, [big[0][wire._SEAL :], b"1234"]))


def test_one_frame_seals_check_the_same_as_the_general_path():
    header = bytes(memoryview(wire.pack(TOKEN, _run(input=torch.randn(4)))[0]))[wire._SEAL :]
    by_parts = [wire.MAGIC + wire.sign(TOKEN, [header]) + header]  # `_tag`, one view
    in_one_go = wire.sealed(TOKEN, [header])  # the one-frame path
    assert by_parts[0][wire._SEAL :] == in_one_go[0][wire._SEAL :]
    for frames in (by_parts, in_one_go):
        assert wire.verify(TOKEN, frames)[0].tobytes() == header
        assert wire.verify(TOKEN, [frames[0], b""][:1])[0].tobytes() == header
    # and a one-frame message checked the general way (as part of a list it is not)
    assert bytes(wire.verify(TOKEN, [bytearray(in_one_go[0])])[0]) == header


def test_the_server_answers_a_record_with_a_record():
    from somatize.remote.server import Compiled

    server = Server(TOKEN)

    class Twice:
        def forward(self, x, ctx):
            return x * 2

    nodes = server.sessions["0123abcd"] = {"k": Twice()}
    server.slices[("0123abcd", "s12")] = Compiled(
        [[0, "k", "t", 0, None, None, "h", False, True]], nodes
    )
    x = torch.randn(5)
    answer = server.handle(as_frames(wire.pack(TOKEN, _run(input=x))))
    assert _is_record(answer)
    reply = wire.unpack(TOKEN, as_frames(answer))
    assert reply["ok"] and reply["rid"] == 77 and torch.equal(reply["value"]["out"][0], x * 2)
    lost = server.handle(as_frames(wire.pack(TOKEN, _run(input=x, sid="s13"))))
    assert not _is_record(lost)  # an error goes as msgpack
    assert wire.unpack(TOKEN, as_frames(lost))["error"]["unknown"]


def _entry(slot, grad, frame, head, data=b""):
    return wire._ENTRY.pack(slot, grad, frame, len(head)) + head + data


HEAD = b'{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 4),
    st.integers(0, 3),
    st.binary(max_size=12),
    st.lists(
        st.tuples(
            st.integers(-3, 3),
            st.integers(0, 3),
            st.integers(0, 3),
            st.sampled_from([HEAD, HEAD[:-3], b"[]", b'{"dtype":"X"}', b"\xff"]),
            st.binary(max_size=12),
        ),
        max_size=3,
    ),
    st.integers(0, 400),
    st.lists(st.binary(max_size=16), max_size=2),
)
def test_signed_random_records_are_a_message_or_malformed_and_never_crash_the_server(
    kind, n, names, entries, cut, data
):
    header = wire._REC.pack(wire._RECORD, kind, n, 5) + names
    header += b"".join(_entry(*e) for e in entries)
    for head in (header, header[: cut % (len(header) + 1)]):
        frames = wire.sealed(TOKEN, [head, *data])
        try:
            back = wire.unpack(TOKEN, as_frames(frames))
        except wire.Malformed:
            pass
        else:  # it added up: a message of the one shape or the other
            assert set(back) in (
                {"op", "rid", "session", "sid", "define", "slice", "given", "input", "timed"},
                {"rid", "ok", "worker", "value"},
            )
        server = Server(TOKEN)
        answer = server.handle(as_frames(frames))
        assert answer is None or wire.unpack(TOKEN, as_frames(answer))["ok"] is False


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 10_000))
def test_a_valid_record_with_any_byte_changed_and_resealed_is_malformed_or_parses(at, value, cut):
    message = _run(given={1: torch.randn(2, 3)}, input=torch.arange(4))
    header = bytearray(bytes(memoryview(wire.pack(TOKEN, message)[0]))[wire._SEAL :])
    header[at % len(header)] = value
    for head in (bytes(header), bytes(header[: cut % (len(header) + 1)])):
        try:
            back = wire.unpack(TOKEN, as_frames(wire.sealed(TOKEN, [head])))
        except wire.Malformed:
            continue
        if head[:1] == bytes([wire._RECORD]):  # still a record: one that adds up
            assert isinstance(back, dict) and "rid" in back
        # else its first byte is no longer the record's: msgpack read it, as any header


def test_a_repeated_run_whose_answer_is_no_record_or_fails_is_answered_as_msgpack():
    from somatize.remote.server import Compiled

    server = Server(TOKEN)

    class Listed:
        def forward(self, x, ctx):
            if x.numel() == 0:
                raise KeyError("nothing to list")
            return x.tolist()

    nodes = server.sessions["0123abcd"] = {"k": Listed()}
    steps = [[0, "k", "lister", 0, None, None, "h", False, True]]
    server.slices[("0123abcd", "s12")] = Compiled(steps, nodes)
    answer = server.handle(as_frames(wire.pack(TOKEN, _run(input=torch.arange(3.0)))))
    assert not _is_record(answer)
    reply = wire.unpack(TOKEN, as_frames(answer))
    assert reply["ok"] and reply["value"] == {"out": {0: [0.0, 1.0, 2.0]}, "ran": []}
    failed = server.handle(as_frames(wire.pack(TOKEN, _run(input=torch.zeros(0)))))
    said = wire.unpack(TOKEN, as_frames(failed))
    assert not said["ok"] and said["error"]["qualname"] == "KeyError"
    assert any("lister" in note for note in said["error"]["notes"])  # the node is named
    assert server.served == 1


def test_run_record_and_answer_record_write_what_pack_writes():
    x, g = torch.randn(5), {2: torch.randn(2, 2)}
    by_pack = wire.unpack(TOKEN, as_frames(wire.pack(TOKEN, _run(given=g, input=x))))
    direct = wire.unpack(TOKEN, as_frames(wire.run_record(TOKEN, 77, "0123abcd", "s12", g, x)))
    assert _same(by_pack, direct)
    out = {0: torch.randn(3)}
    by_pack = wire.unpack(TOKEN, as_frames(wire.pack(TOKEN, _answer(out))))
    direct = wire.unpack(TOKEN, as_frames(wire.answer_record(TOKEN, 78, "feed", out)))
    assert _same(by_pack, direct)
    assert wire.run_record(TOKEN, 1, "s", "i", {0: 1.5}, None) is None  # not a tensor
    assert wire.run_record(TOKEN, 1, "é", "i", {}, x) is None  # not ascii
    assert wire.answer_record(TOKEN, 1, "w", {0: [x]}) is None
    assert wire.answer_record(TOKEN, -1, "w", out) is None  # not a rid a record holds
