"""somatize.codecs and somatize.torch.codec: values written down and read back exactly."""

from __future__ import annotations

import json
import math
import mmap
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from somatize.codecs import Malformed, NoCodec, codec, codecs_registered, decode, digest, encode


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (nan equals nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(plain)
def test_plain_values_round_trip_with_their_types(value: Any) -> None:
    data = encode(value)
    back = decode(data)
    assert same(back, value)
    assert encode(back) == data  # deterministic: the same value gives the same bytes


def test_types_that_json_would_lose_are_kept() -> None:
    value = {
        "tuple": (1, (2, 3), []),
        "empty": (),
        "bool": True,
        "int": 1,
        "float_that_is_whole": 1.0,
        "big": 2**100,
        "negative_big": -(2**64) - 1,
        "uint64": 2**64 - 1,
        "bytes": b"\x00\xff",
        "nan": float("nan"),
        "inf": float("-inf"),
        "surrogate": "x\ud800",
        "nested": [{"a": (True, None)}],
    }
    back = decode(encode(value))
    assert same(back, value)
    assert type(back["tuple"]) is tuple and type(back["tuple"][1]) is tuple
    assert back["bool"] is True and type(back["int"]) is int
    assert type(back["float_that_is_whole"]) is float
    assert back["big"] == 2**100 and back["negative_big"] == -(2**64) - 1


def test_dict_order_is_kept_and_makes_the_bytes() -> None:
    assert list(decode(encode({"b": 1, "a": 2}))) == ["b", "a"]
    assert encode({"a": 1, "b": 2}) == encode({"a": 1, "b": 2})
    assert encode({"a": 1, "b": 2}) != encode({"b": 2, "a": 1})


class Unknown:
    pass


def test_no_codec_names_the_type_the_place_and_what_to_do() -> None:
    with pytest.raises(NoCodec) as caught:
        encode({"x": [1, Unknown()]}, where="node 'enc'")
    message = str(caught.value)
    assert "Unknown" in message
    assert "node 'enc'" in message
    assert "['x'][1]" in message
    assert "somatize.codec(kind, type, dump=..., load=...)" in message
    assert isinstance(caught.value, TypeError)


def test_subclasses_of_plain_types_are_not_silently_flattened() -> None:
    class Label(str):
        pass

    with pytest.raises(NoCodec, match="Label"):
        encode(Label("x"))


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


class Point3(Point):
    pass


def test_a_registered_codec_writes_its_type_and_its_subclasses() -> None:
    codec(
        "test-point",
        Point,
        dump=lambda p: f"{p.x},{p.y}".encode(),
        load=lambda b: Point(*map(int, b.decode().split(","))),
    )
    assert "test-point" in codecs_registered()
    back = decode(encode({"p": (Point(1, 2), Point3(3, 4))}))
    assert isinstance(back["p"], tuple)
    assert [(p.x, p.y) for p in back["p"]] == [(1, 2), (3, 4)]


def test_codec_takes_the_spec_s_parameter_names_by_keyword() -> None:
    class Named:
        def __init__(self, x: int) -> None:
            self.x = x

    codec(
        kind="test-kw", type=Named, dump=lambda n: str(n.x).encode(), load=lambda b: Named(int(b))
    )
    assert decode(encode(Named(7))).x == 7
    before = codecs_registered()
    for wrong, said in (("Named", "str 'Named'"), (Named(7), "Named <")):  # a name, a value
        with pytest.raises(TypeError, match=f"type must be a class, not {said}.*type\\(value\\)"):
            codec(kind="test-kw2", type=wrong, dump=bytes, load=bytes)  # type: ignore[arg-type]
    assert codecs_registered() == before  # refused: nothing registered


def test_registering_a_kind_again_replaces_it() -> None:
    class Thing:
        pass

    codec("test-thing", Thing, dump=lambda t: b"one", load=lambda b: b.decode())
    codec("test-thing", Thing, dump=lambda t: b"two", load=lambda b: b.decode() + "!")
    assert decode(encode(Thing())) == "two!"
    assert codecs_registered().count("test-thing") == 1


def test_codec_refuses_bad_registrations_and_bad_dumps() -> None:
    with pytest.raises(ValueError):
        codec("", int, dump=bytes, load=bytes)
    with pytest.raises(TypeError):
        codec("test-x", "not a type", dump=bytes, load=bytes)  # type: ignore[arg-type]

    class Liar:
        pass

    codec("test-liar", Liar, dump=lambda v: "not bytes", load=lambda b: b)
    with pytest.raises(TypeError, match="test-liar"):
        encode(Liar())


def test_decode_refuses_what_is_not_an_encoded_value() -> None:
    with pytest.raises(ValueError):
        decode(encode([1, 2, 3])[:-1])
    with pytest.raises(ValueError):
        decode(b"\xc1")
    for data in (5, "[1]", None):
        with pytest.raises(Malformed, match=f"the bytes encode wrote, not a {type(data).__name__}"):
            decode(data)
    assert decode(bytearray(encode([1]))) == decode(memoryview(encode([1]))) == [1]
    # what holds the bytes is read as they are: a numpy buffer, a file mapped into memory
    assert decode(np.frombuffer(encode([1, "x"]), dtype=np.uint8)) == [1, "x"]
    with tempfile.TemporaryFile() as f:
        f.write(encode({"a": 2.5}))
        f.flush()
        with mmap.mmap(f.fileno(), 0) as mapped:
            assert decode(mapped) == {"a": 2.5}


def test_a_tuple_whose_items_are_not_a_list_is_malformed_in_a_store_as_on_the_wire() -> None:
    import msgpack

    from somatize.codecs import Malformed
    from somatize.remote import Malformed as WireMalformed
    from somatize.remote import wire

    assert WireMalformed is Malformed and wire.Malformed is Malformed
    for items in ("abc", b"ab", {"a": 1}, 7):
        data = msgpack.packb(msgpack.ExtType(1, msgpack.packb(items)), use_bin_type=True)
        with pytest.raises(Malformed, match="a tuple that holds no items"):
            decode(data)
        with pytest.raises(Malformed, match="a tuple that holds no items"):
            wire.decode([data])


def test_a_codec_that_cannot_load_is_malformed_in_a_message_of_bounded_size() -> None:
    from somatize.codecs import Malformed

    class Frame:
        def __init__(self, data: bytes) -> None:
            self.data = data

    def load(data: bytes) -> Frame:  # as pyarrow does, its error quotes what it was given
        raise TypeError(f"cannot construct a FileSource from {data!r}")

    codec("test-frame", Frame, dump=lambda f: f.data, load=load)
    with pytest.raises(Malformed) as refused:
        decode(encode(Frame(bytes(range(256)) * 4096)))  # 1 MiB
    said = str(refused.value)
    assert len(said) < 1000, len(said)
    assert "'test-frame'" in said and "TypeError: cannot construct a FileSource" in said


def test_decode_names_a_kind_nobody_registered() -> None:
    class Gone:
        pass

    codec("test-gone", Gone, dump=lambda v: b"", load=lambda b: Gone())
    data = encode({"x": Gone()})
    script = textwrap.dedent(
        """
        import sys
        from somatize.codecs import NoCodec, decode
        try:
            decode(sys.stdin.buffer.read())
        except NoCodec as error:
            print(error)
        """
    )
    done = subprocess.run(  # a process where nobody registered the kind
        [sys.executable, "-c", script], input=data, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    said = done.stdout.decode()
    assert "'test-gone'" in said and "somatize.codecs.codec('test-gone'" in said


def test_digest_is_sha256_of_the_bytes() -> None:
    import hashlib

    assert digest(b"abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()


def test_numpy_values_round_trip_with_their_dtype() -> None:
    np = pytest.importorskip("numpy")
    value = [np.float32(1.5), np.arange(6, dtype=np.int16).reshape(2, 3), np.bool_(True)]
    back = decode(encode(value))
    assert type(back[0]) is np.float32 and back[0] == np.float32(1.5)
    assert back[1].dtype == np.int16 and back[1].shape == (2, 3)
    assert (back[1] == value[1]).all()
    assert type(back[2]) is np.bool_


# -- tensors --------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
import somatize.torch  # noqa: E402,F401  (registers the tensor codec)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
def test_tensors_keep_their_dtype_and_numbers(dtype: Any) -> None:
    tensor = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    back = decode(encode(tensor))
    assert back.dtype == dtype and back.shape == (3, 4)
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1,), (2, 3, 4)])
def test_tensors_keep_their_shape(shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape)
    back = decode(encode(tensor))
    assert back.shape == tensor.shape and back.dim() == len(shape)
    assert torch.equal(back, tensor)


def test_views_grad_and_parameters_are_written_as_plain_tensors() -> None:
    base = torch.randn(4, 5, requires_grad=True)
    view = (base * 2).t()[1:, ::2]
    assert not view.is_contiguous()
    back = decode(encode({"view": view, "param": torch.nn.Parameter(torch.ones(3))}))
    assert torch.equal(back["view"], view.detach())
    assert not back["view"].requires_grad and back["view"].device.type == "cpu"
    assert type(back["param"]) is torch.Tensor and torch.equal(back["param"], torch.ones(3))


def test_tensor_bytes_are_deterministic_and_nested_values_keep_types() -> None:
    value = {"x": (torch.ones(2, dtype=torch.bfloat16), 3), "y": [torch.tensor(7)]}
    assert encode(value) == encode(
        {"x": (torch.ones(2, dtype=torch.bfloat16), 3), "y": [torch.tensor(7)]}
    )
    back = decode(encode(value))
    assert type(back["x"]) is tuple and back["x"][1] == 3
    assert back["y"][0].dim() == 0 and back["y"][0].item() == 7
    assert "torch.Tensor" in codecs_registered()


def test_tensors_that_have_no_plain_numbers_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="to_dense"):
        encode(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="meta"):
        encode(torch.empty(2, device="meta"))


def test_a_tensor_refused_deep_in_a_value_is_named_with_where_it_sits(tmp_path) -> None:
    from somatize import Graph, Node, Store

    store = Store(tmp_path / "store")
    with pytest.raises(TypeError, match=r"kept as 'out' at \['h'\]\[1\]: .*meta device.*real"):
        store.keep("out", {"h": [1, torch.empty(2, device="meta")]})
    with pytest.raises(TypeError, match=r"kept as 'out' at \[0\]: .*sparse.*to_dense"):
        store.keep("out", (torch.eye(2).to_sparse(), 1))
    assert store.names() == []  # nothing written

    class Shapes(Node):
        def forward(self, input, ctx):
            return {"hidden": torch.empty(input, 4, device="meta")}

    with pytest.raises(TypeError, match=r"node 'shapes' at \['hidden'\]: .*meta device"):
        Graph.somatize(Shapes().cached()).forward(3, store=store)
    assert store.names() == []


def test_a_value_too_large_for_one_msgpack_value_is_refused_naming_it() -> None:
    import numpy as np

    class Huge:
        pass

    # 4 GiB that are never touched (np.zeros asks the system for zeroed pages lazily)
    codec("test-huge", Huge, dump=lambda v: memoryview(np.zeros(2**32, np.uint8)), load=bytes)
    with pytest.raises(ValueError, match=r"node 'big' at \['w'\]: it is 4,294,967,296 bytes"):
        encode({"w": Huge()}, where="node 'big'")


def test_lists_or_dicts_nested_past_msgpacks_bound_are_refused_naming_the_value() -> None:
    for make in (lambda v: [v], lambda v: {"a": v}):
        value: Any = 0
        for _ in range(2000):
            value = make(value)
        with pytest.raises(ValueError, match="node 'deep': lists or dicts nested more than 1024"):
            encode(value, where="node 'deep'")


def test_what_encode_writes_near_msgpacks_bound_decode_reads_back() -> None:
    # A list or dict counts as one level, an empty one too; what sits innermost is a leaf.
    for make in (lambda v: [v], lambda v: {"a": v}):
        for leaf, levels_of_its_own in ((0, 0), ("x", 0), ((), 0), ([], 1), ({}, 1)):
            for levels in range(1020, 1030):
                value: Any = leaf
                for _ in range(levels - levels_of_its_own):
                    value = make(value)
                if levels > 1024:
                    with pytest.raises(ValueError, match="'deep': lists or dicts nested more than"):
                        encode(value, where="node 'deep'")
                else:  # == on values this deep passes Python's recursion limit: compare bytes
                    data = encode(value)
                    assert encode(decode(data)) == data, (leaf, levels)


def test_tensor_bytes_decode_without_importing_somatize_torch_first() -> None:
    data = encode(torch.arange(3, dtype=torch.int16))
    script = textwrap.dedent(
        """
        import sys
        from somatize.codecs import decode
        assert "somatize.torch" not in sys.modules
        value = decode(sys.stdin.buffer.read())
        print(value.dtype, value.tolist())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=data, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == ["torch.int16", "[0,", "1,", "2]"]


def test_the_first_tensor_kept_in_a_process_that_never_imported_somatize_torch(tmp_path) -> None:
    """A notebook that imports torch and the Store, and keeps an optimizer's state first thing:
    the tensor codec is somatize.torch's, registered when the first tensor is met, and that
    first value is kept (it was refused, and only the second one kept)."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from somatize import Store
        assert "somatize.torch" not in sys.modules
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([w], lr=0.1)
        w.grad = torch.full((3,), 0.5)
        opt.step()
        store = Store(sys.argv[1])
        store.keep("opt", opt.state_dict())
        back = store.recall("opt")
        print(back["state"][0]["step"].item(), back["state"][0]["exp_avg"].tolist())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    step, avg = done.stdout.decode().split(" ", 1)
    assert float(step) == 1.0
    assert [round(v, 6) for v in json.loads(avg)] == [0.05, 0.05, 0.05]  # (1 − 0.9) · 0.5


def test_an_ordered_dict_comes_back_as_one_in_its_order() -> None:
    import collections

    import msgpack

    value = collections.OrderedDict([("b", 1), ((1, 2), [3.5, None]), ("a", {"x": (4,)})])
    back = decode(encode(value))
    assert type(back) is collections.OrderedDict and list(back.items()) == list(value.items())
    assert type(back[(1, 2)]) is list and type(back["a"]["x"]) is tuple
    assert encode(value) == encode(collections.OrderedDict(value))  # the same bytes
    assert decode(encode({"o": collections.OrderedDict()})) == {"o": collections.OrderedDict()}

    class Sorted(collections.OrderedDict):  # a subclass is not written down as its base
        pass

    with pytest.raises(NoCodec, match="Sorted"):
        encode(Sorted(a=1))
    with pytest.raises(NoCodec, match=r"in node 'n' at \['w'\]\[1\]"):  # a state_dict's place
        encode(collections.OrderedDict(w=[1, object()]), where="node 'n'")
    for items in ([1, 2], [[1, 2, 3]], [[[1], 2]], "pairs"):  # hostile: refused, not a crash
        data = msgpack.packb(msgpack.ExtType(4, msgpack.packb(items)))
        with pytest.raises(ValueError, match="OrderedDict"):
            decode(data)


def test_a_codec_error_that_takes_other_arguments_is_raised_as_it_is_with_a_note() -> None:
    class Refusal(Exception):
        def __init__(self, code: int, why: str) -> None:
            super().__init__(code, why)

    class Odd:
        pass

    def dump(value: Odd) -> bytes:
        raise Refusal(7, "cannot")

    codec("test-odd", Odd, dump=dump, load=lambda b: Odd())
    with pytest.raises(Refusal) as refused:  # not rebuilt with the text: a note says where
        encode({"w": [Odd()]}, where="node 'n'")
    assert refused.value.args == (7, "cannot")
    (said,) = refused.value.__notes__
    assert "codec 'test-odd'" in said and "node 'n' at ['w'][0]" in said
