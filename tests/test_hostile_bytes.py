"""Hostile bytes: decode, Store.recall and what they read refuse them and the process lives.

Every decode here runs in a child process (one per test module, fed over a pipe), so a
decoder that crashes is a failed test naming the bytes that killed it, not a dead pytest.
"""

from __future__ import annotations

import select
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from _children import DECODER, tuples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize.codecs import DEPTH, encode


class Decoder:
    """A child process that decodes what it is sent; `ask` answers within `seconds` or fails."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DECODER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def ask(self, data: bytes, seconds: float = 30.0) -> str:
        assert self.proc.poll() is None, "the decoder died earlier"
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        if not ready:
            self.proc.kill()
            pytest.fail(f"decode of {len(data)} bytes {data[:40]!r} took over {seconds} s")
        line = self.proc.stdout.readline().decode()
        if not line:
            code = self.proc.wait(timeout=10)
            error = self.proc.stderr.read().decode()[-2000:]
            pytest.fail(
                f"decode of {len(data)} bytes {data[:40]!r} killed the process "
                f"(exit {code}): {error}"
            )
        return line.strip()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def decoder() -> Iterator[Decoder]:
    child = Decoder()
    yield child
    child.close()


def test_the_900_byte_value_that_killed_decode_is_refused(decoder: Decoder) -> None:
    data = tuples(195)
    assert 850 < len(data) < 1000
    answer = decoder.ask(data)
    assert answer.startswith("refused Malformed"), answer
    assert f"more than {DEPTH} deep" in answer and "DEPTH" in answer
    for depth in (DEPTH + 1, 2_000, 20_000):
        assert decoder.ask(tuples(depth)).startswith("refused Malformed")
    assert decoder.ask(tuples(DEPTH)) == "ok tuple"


def test_lists_and_dicts_nested_past_msgpacks_stack_are_refused(decoder: Decoder) -> None:
    assert decoder.ask(b"\x91" * 1000 + b"\xc0") == "ok list"
    for data in (b"\x91" * 5_000 + b"\xc0", b"\x81\xc0" * 5_000 + b"\xc0"):
        answer = decoder.ask(data)
        assert answer.startswith("refused Malformed") and "1024 deep" in answer


def test_what_encode_writes_is_what_decode_reads_and_no_deeper() -> None:
    value: object = None
    for _ in range(DEPTH):
        value = (value,)
    assert len(repr(value)) > DEPTH
    encode(value)
    with pytest.raises(ValueError, match=r"^node 'deep': tuples .*more than 32 deep"):
        encode((value,), where="node 'deep'")  # named, as lists or dicts too deep are


def test_lengths_longer_than_their_bytes_are_refused(decoder: Decoder) -> None:
    for data in (
        b"\xdd\xff\xff\xff\xff",  # an array of 4 billion items, in 5 bytes
        b"\xdf\xff\xff\xff\xff\xc0",  # a map of as many pairs
        b"\xc6\xff\xff\xff\xff" + b"\x00" * 10,  # 4 GiB of bytes
        b"\xdb\xff\xff\xff\xff" + b"a" * 10,  # 4 GiB of text
        b"\xc9\xff\xff\xff\xff\x01",  # an extension of 4 GiB
    ):
        answer = decoder.ask(data)
        assert answer.startswith("refused Malformed"), (data, answer)


def test_extensions_that_lie_about_what_they_hold_are_refused(decoder: Decoder) -> None:
    np = pytest.importorskip("numpy")
    import io

    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        stream, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
    )
    huge = b"a" + stream.getvalue()  # an array header, and no numbers after it
    cases = {
        "numpy header promising 8 TB": msgpack.packb(msgpack.ExtType(17, huge)),
        "envelope that is not (kind, bytes)": msgpack.packb(
            msgpack.ExtType(3, msgpack.packb([1, 2]))
        ),
        "envelope nesting an envelope": msgpack.packb(
            msgpack.ExtType(3, msgpack.packb([msgpack.ExtType(3, b""), b""]))
        ),
        "tensor that is not safetensors": msgpack.packb(msgpack.ExtType(16, b"\xff" * 64)),
        "tuple of nothing": msgpack.packb(msgpack.ExtType(1, b"")),
        "extension code nobody wrote": msgpack.packb(msgpack.ExtType(99, b"x")),
        "a list as a map key": b"\x81\x91\x01\x02",
    }
    for what, data in cases.items():
        answer = decoder.ask(data)
        assert answer.startswith("refused Malformed"), (what, answer)
    answer = decoder.ask(msgpack.packb(msgpack.ExtType(3, msgpack.packb(["no-such-kind", b""]))))
    assert answer.startswith("refused NoCodec") and "no-such-kind" in answer


# -- random and adversarial bytes -----------------------------------------------------------

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A real encoding with a few bytes flipped, cut out, put in, or the tail cut off."""
    data = bytearray(encode(draw(plain)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["flip", "cut", "insert", "truncate"]))
        if how == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del data[at : at + draw(st.integers(1, 8))]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:]
    return bytes(data)


@st.composite
def extensions(draw: st.DrawFn) -> bytes:
    """Our own extension codes around random or nested payloads, mixed with lists and maps."""
    data = draw(st.binary(max_size=16))
    for _ in range(draw(st.integers(1, 60))):
        code = draw(st.sampled_from([1, 1, 1, 2, 3, 16, 17, 42]))
        wrap = draw(st.sampled_from(["ext", "list", "map", "envelope"]))
        if wrap == "ext":
            data = msgpack.packb(msgpack.ExtType(code, data))
        elif wrap == "list":
            data = b"\x91" + data
        elif wrap == "map":
            data = b"\x81\xa1k" + data
        else:
            data = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["k", data])))
    return data


hostile = st.binary(max_size=2_000) | mangled() | extensions()


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(hostile)
def test_random_and_adversarial_bytes_never_kill_the_decoder(decoder: Decoder, data: bytes) -> None:
    answer = decoder.ask(data)
    assert answer.startswith(("ok ", "refused Malformed", "refused NoCodec")), answer


# -- what reads through decode: a store ------------------------------------------------------

RECALL = textwrap.dedent(
    """
    import sys
    from somatize import Store
    from somatize.codecs import Malformed
    store = Store(sys.argv[1])
    try:
        store.recall("hostile")
    except Malformed as error:
        print("refused", error)
    """
)


def test_recall_of_a_hostile_value_is_a_clear_error(tmp_path: Path) -> None:
    from somatize import Store

    store = Store(tmp_path)
    store.bind("hostile", store.put(tuples(195)))
    done = subprocess.run(
        [sys.executable, "-c", RECALL, str(tmp_path)], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().startswith("refused") and "32 deep" in done.stdout.decode()


THREADED = textwrap.dedent(
    """
    import sys, threading
    import msgpack
    from somatize.codecs import DEPTH, Malformed, decode

    def tuples(depth):
        data = msgpack.packb(None)
        for _ in range(depth):
            data = msgpack.packb(msgpack.ExtType(1, b"\\x91" + data))
        return data

    answers = []

    def work():
        answers.append(type(decode(tuples(DEPTH))).__name__)
        try:
            decode(tuples(195))
        except Malformed:
            answers.append("refused")

    threading.stack_size(int(sys.argv[1]))
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(*answers)
    """
)


def test_the_deepest_value_allowed_reads_back_on_a_thread_with_a_2_mib_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-c", THREADED, str(2 * 2**20)], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["tuple", "refused"]


# -- what a token holder sends a worker --------------------------------------------------------


def test_a_token_holders_text_that_is_not_utf8_is_answered_with_an_error_and_the_worker_serves():
    from _sealed import sealed

    from somatize import Broker, Worker
    from somatize.remote import wire

    worker = Worker.spawn(send=["_remote_nodes"])
    sock, sealer = sealed(worker)
    try:
        lone = msgpack.ExtType(5, msgpack.packb("\udcff", unicode_errors="surrogatepass"))
        definition = {"key": "k", "module": lone, "qualname": "Plus"}
        for hostile in ({"op": "hello", "rid": lone}, {"op": "define", "define": [definition]}):
            sock.send_multipart(sealer.seal([msgpack.packb(hostile)]))
            answer = wire.decode(sealer.open(sock.recv_multipart()))  # within 15 s
            assert answer["ok"] is False and "not UTF-8" in answer["error"]["message"]
        with Broker.embedded({"w": Worker.at(worker.address, token=worker.token)}) as b:
            assert b.request("w", {"op": "hello"}, deadline=15)["pid"] == worker.pid
    finally:
        sock.close(0)
        worker.stop()
