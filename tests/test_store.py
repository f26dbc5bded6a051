"""somatize.store: blobs by content, names that point at them, atomic writes, one claimer."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from _children import WRITER

from somatize.codecs import NoCodec, digest, encode
from somatize.store import Bound, CorruptBinding, CorruptBlob, Store


@pytest.fixture(params=["dir", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "dir":
        return Store(tmp_path / "store")
    return Store(f"memory://test-{uuid.uuid4().hex}")


def test_a_directory_is_created_and_repr_says_where(tmp_path: Path) -> None:
    where = tmp_path / "a" / "b"
    s = Store(where)
    assert where.is_dir()
    assert repr(s) == f"Store({str(where)!r})"
    assert repr(Store("memory://here")) == "Store('memory://here')"


def test_a_store_is_opened_on_a_directory_or_a_url_and_nothing_else(tmp_path: Path) -> None:
    for bad in (5, None, b"/tmp/x"):  # bytes too: a store's where is text
        kind = type(bad).__name__
        with pytest.raises(TypeError, match=f"a store is a directory or a URL, not {kind}"):
            Store(bad)


def test_a_directory_under_the_home_directory_is_named_as_in_a_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    s = Store("~/runs")
    s.keep("x", 1)
    assert (tmp_path / "home" / "runs" / "blobs").is_dir()
    assert not (tmp_path / "~").exists()  # no directory called '~' where the script ran
    assert s.where == "~/runs" and Store("~/runs").recall("x") == 1


def test_put_and_get_by_content(store: Store) -> None:
    key = store.put(b"hello")
    assert key == digest(b"hello") and key.startswith("sha256:")
    assert store.put(b"hello") == key
    assert store.get(key) == b"hello"
    assert store.get(digest(b"never put")) is None
    assert store.get(store.put(b"")) == b""
    with pytest.raises(ValueError, match="not a digest"):
        store.get("md5:abc")
    with pytest.raises(TypeError):
        store.put("text")  # type: ignore[arg-type]


def test_bind_resolve_and_overwrite(store: Store) -> None:
    one, two = store.put(b"1"), store.put(b"2")
    assert store.resolve("x") is None
    before = time.time()
    store.bind("x", one, {"step": 3, "ok": True, "shape": (2, 3)})
    bound = store.resolve("x")
    assert isinstance(bound, Bound)
    assert bound.name == "x" and bound.digest == one
    assert bound.meta == [("step", 3), ("ok", True), ("shape", (2, 3))]
    assert type(bound.meta[1][1]) is bool and type(bound.meta[2][1]) is tuple
    assert before - 1 <= bound.when <= time.time() + 1
    assert bound.get("step") == 3 and bound.get("missing", 0) == 0
    store.bind("x", two, [("a", 1)])
    assert store.resolve("x").digest == two
    assert store.resolve("x").meta == [("a", 1)]


def test_claim_binds_only_the_first_time(store: Store) -> None:
    one, two = store.put(b"1"), store.put(b"2")
    assert store.claim("fed/round/0/client/2", one, {"size": 10}) is True
    assert store.claim("fed/round/0/client/2", two) is False
    bound = store.resolve("fed/round/0/client/2")
    assert bound.digest == one and bound.meta == [("size", 10)]
    store.bind("taken", one)
    assert store.claim("taken", two) is False
    assert store.resolve("taken").digest == one


def test_bound_lists_every_binding_and_prefixes(store: Store) -> None:
    key = store.put(b"v")
    names = ["run/r1/0", "run/r1/1", "run/r10/0", "run", "cache/ab/sha256:ab", "odd name/ü/.dot"]
    for name in names:
        store.bind(name, key)
    assert [b.name for b in store.bound()] == sorted(names)
    assert all(b.digest == key for b in store.bound())
    assert [b.name for b in store.bound("run/r1")] == ["run/r1/0", "run/r1/1"]
    assert store.names("run") == ["run", "run/r1/0", "run/r1/1", "run/r10/0"]
    assert store.bound("nothing/here") == []


def test_keep_and_recall_values_through_codecs(store: Store) -> None:
    value = {"loss": 0.5, "step": 3, "done": False, "shape": (2, 3), "raw": b"\x00", "n": 2**80}
    key = store.keep("run/r/0", value, meta={"forward": 0})
    assert store.resolve("run/r/0").digest == key
    back = store.recall("run/r/0")
    assert back == value and type(back["shape"]) is tuple and back["done"] is False
    assert store.recall("never/kept") is None


def test_the_methods_take_the_spec_s_parameter_names_by_keyword(store: Store) -> None:
    one, two = store.put(b"1"), store.put(data=b"2")
    assert store.get(digest=one) == b"1"
    store.bind(name="b", digest=one, meta={"k": 1})
    assert store.claim(name="c", digest=two, meta=None) is True
    assert store.claim(name="c", digest=one) is False
    assert store.resolve(name="b").meta == [("k", 1)] and store.resolve("c").digest == two
    assert [b.name for b in store.bound(prefix="c")] == ["c"]
    kept = store.keep(name="v", value=(1, 2), meta={"step": 0})
    assert store.recall(name="v") == (1, 2) and store.resolve("v").digest == kept


@pytest.mark.parametrize("name", ["", "/abs", "a//b", "a/", "..", "a/../b", "./a", "a/."])
def test_bad_names_are_refused_and_nothing_is_written(store: Store, name: str) -> None:
    key = store.put(b"v")
    with pytest.raises(ValueError, match="name"):
        store.bind(name, key)
    with pytest.raises(ValueError):
        store.keep(name, 1)
    with pytest.raises(ValueError):
        store.claim(name, key)
    assert store.bound() == []


def test_refused_values_and_meta_leave_the_store_as_it_was(store: Store) -> None:
    store.keep("x", 1)
    with pytest.raises(NoCodec, match="'x'"):
        store.keep("x", object())
    with pytest.raises(NoCodec, match="meta"):
        store.bind("x", store.put(b"2"), {"bad": object()})
    with pytest.raises(ValueError, match="digest"):
        store.bind("x", "sha256:nothex")
    for meta in (["ab"], "ab", [b"ab"], 5):  # a two-letter string is not a (key, value) pair
        with pytest.raises(TypeError, match="meta of 'x' is a dict or"):
            store.bind("x", store.put(b"2"), meta)
    assert store.recall("x") == 1


def test_keep_refusing_its_meta_leaves_no_blob_behind(store: Store) -> None:
    value = {"weights": list(range(50))}
    key = digest(encode(value))
    for meta in ({"bad": object()}, ["ab"], {1: "not a str key"}, 5):
        with pytest.raises((NoCodec, TypeError), match="meta"):
            store.keep("x", value, meta)
        assert store.get(key) is None and store.resolve("x") is None
    assert store.keep("x", value, {"ok": 1}) == key and store.get(key) == encode(value)


def test_a_blob_that_does_not_hash_to_its_name_is_never_returned(tmp_path: Path) -> None:
    store = Store(tmp_path)
    key = store.keep("v", list(range(100)))
    hexed = key.split(":")[1]
    path = tmp_path / "blobs" / "sha256" / hexed[:2] / hexed[2:]
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlob) as caught:
        store.get(key)
    assert key in str(caught.value) and str(path) in str(caught.value)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(CorruptBlob):
        store.recall("v")
    # putting the value again repairs it
    store.keep("v", list(range(100)))
    assert store.recall("v") == list(range(100))


def test_a_corrupt_blob_in_memory_is_reported_too() -> None:
    import fsspec

    where = f"test-{uuid.uuid4().hex}"
    store = Store(f"memory://{where}")
    key = store.put(b"abc")
    hexed = key.split(":")[1]
    fsspec.filesystem("memory").pipe_file(f"/{where}/blobs/sha256/{hexed[:2]}/{hexed[2:]}", b"abd")
    with pytest.raises(CorruptBlob, match=key):
        store.get(key)


def test_a_torn_binding_is_reported_not_ignored(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.keep("run/r/0", {"a": 1})
    binding = tmp_path / "names" / "run" / "r" / "0" / ".bind"
    binding.write_bytes(binding.read_bytes()[:7])
    with pytest.raises(CorruptBinding, match="run/r/0") as caught:
        store.resolve("run/r/0")
    assert str(binding) in str(caught.value)
    with pytest.raises(CorruptBinding):
        store.bound()
    with pytest.raises(CorruptBinding):
        store.recall("run/r/0")


@pytest.mark.parametrize("where", ["dir", "memory"])
def test_a_failed_write_keeps_the_old_value_and_leaves_no_debris(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    store = Store(tmp_path / "s") if where == "dir" else Store(f"memory://t-{uuid.uuid4().hex}")
    store.keep("model", {"version": 1})

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk pulled out mid-write")

    with monkeypatch.context() as patch:
        if where == "dir":  # the rename into place fails
            patch.setattr(os, "replace", crash)
        else:  # an object store writes a whole object or nothing: fail the put itself
            patch.setattr(MemoryFileSystem, "pipe_file", crash)
        with pytest.raises(OSError, match="disk pulled"):
            store.keep("model", {"version": 2})
        with pytest.raises(OSError, match="disk pulled"):
            store.bind("model", digest(b"x"))
    assert store.recall("model") == {"version": 1}
    assert [b.name for b in store.bound()] == ["model"]
    if where == "dir":
        leftovers = [p.name for p in (tmp_path / "s").rglob("*") if p.name.startswith(".tmp-")]
        assert leftovers == []


@pytest.mark.parametrize("pause", [0.0, 0.013, 0.037])
def test_a_writer_killed_mid_write_leaves_a_whole_value(tmp_path: Path, pause: float) -> None:
    store = Store(tmp_path)
    store.keep("big", {"i": 0, "payload": b"\x00" * 4_000_000})
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "4000000"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        deadline = time.time() + 20
        while time.time() < deadline and store.recall("big")["i"] < 2:
            time.sleep(0.01)
        time.sleep(pause)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
    value = store.recall("big")
    assert value["i"] >= 2
    assert value["payload"] == bytes([value["i"] % 256]) * 4_000_000
    assert [b.name for b in store.bound()] == ["big"]


def _claimer(where: str, barrier: object, mine: int, results: object) -> None:
    store = Store(where)
    key = store.put(f"client {mine}".encode())
    barrier.wait(timeout=60)  # type: ignore[attr-defined]
    results.put((mine, key, store.claim("fed/round/0/winner", key, {"who": mine})))  # type: ignore[attr-defined]


def test_exactly_one_of_eight_processes_wins_a_claim(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(8)
    results = context.Queue()
    workers = [
        context.Process(target=_claimer, args=(str(tmp_path), barrier, i, results))
        for i in range(8)
    ]
    for worker in workers:
        worker.start()
    answers = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    winners = [(mine, key) for mine, key, won in answers if won]
    assert len(winners) == 1
    bound = Store(tmp_path).resolve("fed/round/0/winner")
    assert bound.digest == winners[0][1]
    assert bound.meta == [("who", winners[0][0])]


def _race(store: Store, name: str, keys: list[str]) -> list[int]:
    barrier = threading.Barrier(len(keys))
    won: list[int] = []

    def claim(i: int) -> None:
        barrier.wait()
        if store.claim(name, keys[i]):
            won.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won


def test_exactly_one_of_many_threads_wins_a_claim(store: Store) -> None:
    keys = [store.put(f"t{i}".encode()) for i in range(16)]
    for round_ in range(5):
        won = _race(store, f"round/{round_}", keys)
        assert len(won) == 1
        assert store.resolve(f"round/{round_}").digest == keys[won[0]]


def test_threads_keeping_and_recalling_at_once_see_whole_values(store: Store) -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                store.keep(f"t/{i}", {"i": i, "j": j})
                store.keep("shared", [i, j] * 100)
                seen = store.recall("shared")
                assert len(seen) == 200 and seen == seen[:2] * 100
                assert store.recall(f"t/{i}") == {"i": i, "j": j}
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.bound()) == 7


def test_a_store_travels_to_another_process_by_where(tmp_path: Path) -> None:
    store = Store(tmp_path)
    again = pickle.loads(pickle.dumps(store))
    assert isinstance(again, Store) and again.where == store.where
    store.keep("x", (1, 2))
    assert again.recall("x") == (1, 2)


def test_file_urls_are_local_directories(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.keep("a/b", 1)
    assert (tmp_path / "names" / "a" / "b" / ".bind").is_file()
    assert Store(tmp_path).recall("a/b") == 1


def test_an_opaque_is_kept_as_the_value_it_wraps(store: Store) -> None:
    from somatize import Opaque

    value = {"loss": 0.5, "shape": (2, 3)}
    key = store.keep("bare", value)
    assert store.keep("wrapped", Opaque(value)) == key
    assert store.keep("inside", {"loss": Opaque(0.5), "shape": (Opaque(2), 3)}) == key
    assert store.recall("wrapped") == value and type(store.recall("inside")["shape"]) is tuple


def test_encoded_bytes_are_what_is_kept(store: Store) -> None:
    key = store.keep("v", {"a": (1,)})
    assert key == digest(encode({"a": (1,)}))
    assert store.get(key) == encode({"a": (1,)})


def test_names_too_long_for_a_file_or_a_key_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="name .* too long"):
        store.bind("x" * 300, store.put(b"v"))
    with pytest.raises(ValueError, match="name .* too long"):
        store.keep("/".join(["segment"] * 200), 1)
    assert store.names() == []


def test_clean_refuses_an_age_that_is_not_seconds_by_what_was_passed(store: Store) -> None:
    for bad in ("5", None):
        with pytest.raises(TypeError, match=f"older_than is seconds >= 0, not {bad!r}"):
            store.clean(older_than=bad)
    for bad in (-1, float("nan"), True):
        with pytest.raises(ValueError, match="older_than is seconds >= 0"):
            store.clean(older_than=bad)
    assert store.clean(older_than=0) == {"files": 0, "bytes": 0}
    assert store.clean(older_than=np.int64(3600)) == {"files": 0, "bytes": 0}  # a real number
