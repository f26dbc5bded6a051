"""A store under bad luck and bad intent: killed writers and claimers, hostile names, damaged
bytes. Real processes killed by pid, a real directory, bounded trials."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _children import STUCK_CLAIMER, WRITER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize import Store
from somatize.store import CorruptBinding, CorruptBlob


def writer(where: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(where), "4000000"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def temp_files(where: Path) -> list[Path]:
    return sorted(p for p in where.rglob("*") if p.name.startswith(".tmp-"))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def stopped_mid_write(proc: subprocess.Popen, where: Path, seen: int = 0) -> list[Path]:
    """Stop `proc` (SIGSTOP) over and over until more than `seen` temp files are there, and
    leave it stopped: the temp files then. Empty, and `proc` running, if a minute passes."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)
        live = temp_files(where)
        if len(live) > seen:
            return live
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.007)
    return []


def test_clean_removes_what_killed_writers_left_and_keeps_the_value(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.keep("big", {"i": 0, "payload": b"\x00" * 4_000_000})
    for seen in range(2):  # two writers killed mid-write, each leaving its temp file
        proc = writer(tmp_path)
        left = stopped_mid_write(proc, tmp_path, seen)
        stop(proc)  # SIGKILL, where it stands
        assert len(left) > seen, "a writer was never caught mid-write in a minute"
    size = sum(p.stat().st_size for p in left)
    value = store.recall("big")
    removed = store.clean()
    assert removed == {"files": len(left), "bytes": size}, (left, removed)
    assert temp_files(tmp_path) == []
    assert (
        store.recall("big") == value and value["payload"] == bytes([value["i"] % 256]) * 4_000_000
    )
    assert store.clean() == {"files": 0, "bytes": 0}
    with pytest.raises(ValueError, match="older_than"):
        store.clean(older_than=-1)


def test_clean_never_touches_a_live_writers_file(tmp_path: Path) -> None:
    store = Store(tmp_path)
    proc = writer(tmp_path)
    try:
        live = stopped_mid_write(proc, tmp_path)
        assert live, "the writer was never caught mid-write in a minute"
        deadline = time.monotonic() + 60
        assert store.clean(older_than=0) == {"files": 0, "bytes": 0}
        assert temp_files(tmp_path) == live
        proc.send_signal(signal.SIGCONT)
        seen = store.recall("big")["i"] if store.resolve("big") else 0
        while store.recall("big") is None or store.recall("big")["i"] <= seen + 1:
            assert time.monotonic() < deadline, "the writer did not go on after clean"
            time.sleep(0.01)
    finally:
        stop(proc)
    store.clean()
    assert temp_files(tmp_path) == []


def test_clean_takes_a_temp_file_whose_pid_no_process_can_have(tmp_path: Path) -> None:
    """A temp file named by this machine but with a pid past any pid (or not an ASCII number),
    as a damaged or hostile store may hold: clean removes it once old, and does not crash."""
    store = Store(tmp_path)
    proc = writer(tmp_path)
    try:
        live = stopped_mid_write(proc, tmp_path)
        assert live, "the writer was never caught mid-write in a minute"
        machine = live[0].name.split("-")[-3]  # the writer's name says this machine
        folder = live[0].parent
    finally:
        stop(proc)
    store.clean(older_than=0)
    odd = []
    for pid in ("9" * 30, "\u00b2", "\u0663"):
        path = folder / f".tmp-x-{machine}-{pid}-abcdef012345"
        path.write_bytes(b"left")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
        odd.append(path)
    assert store.clean(older_than=3600) == {"files": 3, "bytes": 12}
    assert not any(p.exists() for p in odd)


def test_without_hard_links_a_claimer_killed_mid_claim_leaves_the_name_claimable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "this filesystem has no hard links")

    monkeypatch.setattr(os, "link", no_links)
    store = Store(tmp_path)
    mine = store.put(b"mine")
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_CLAIMER, str(tmp_path), "fed/round/0/averager"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "claiming"
        assert store.claim("fed/round/0/averager", mine) is False  # it is claiming, and alive
        assert store.resolve("fed/round/0/averager") is None
    finally:
        proc.send_signal(signal.SIGKILL)
        stop(proc)
    assert store.claim("fed/round/0/averager", mine) is True
    assert store.claim("fed/round/0/averager", store.put(b"late")) is False
    assert store.resolve("fed/round/0/averager").digest == mine
    store.clean()
    folder = tmp_path / "names" / "fed" / "round" / "0" / "averager"
    assert [p.name for p in folder.iterdir()] == [".bind"]
    assert temp_files(tmp_path) == []


# -- hostile names and damaged bytes --------------------------------------------------------

names = st.lists(
    st.sampled_from(["..", ".", "", "a", "b", ".bind", ".tmp-x", "%2e%2e", "\\", "\x00", "~"])
    | st.text(max_size=12),
    min_size=1,
    max_size=6,
).map("/".join) | st.text(max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names)
def test_no_name_escapes_the_directory_or_collides_with_the_stores_own_files(name: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as top:
        root = Path(top) / "store"
        store = Store(root)
        key = store.put(b"v")
        try:
            store.bind(name, key)
        except (ValueError, TypeError) as error:
            assert "name" in str(error)
            assert store.names() == []
        else:
            assert store.names() == [name] and store.resolve(name).name == name
        outside = [p for p in Path(top).rglob("*") if root not in p.parents and p != root]
        assert outside == []
        assert store.clean(older_than=0) == {"files": 0, "bytes": 0}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=64), st.data())
def test_any_change_to_a_blob_is_reported_never_returned(value: bytes, data: st.DataObject) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as top:
        store = Store(top)
        key = store.keep("v", value)
        hexed = key.split(":")[1]
        path = Path(top) / "blobs" / "sha256" / hexed[:2] / hexed[2:]
        original = path.read_bytes()
        how = data.draw(st.sampled_from(["flip", "truncate", "append", "replace"]))
        if how == "flip":
            at = data.draw(st.integers(0, len(original) - 1))
            damaged = bytearray(original)
            damaged[at] ^= data.draw(st.integers(1, 255))
            damaged = bytes(damaged)
        elif how == "truncate":
            damaged = original[: data.draw(st.integers(0, len(original) - 1))]
        elif how == "append":
            damaged = original + data.draw(st.binary(min_size=1, max_size=8))
        else:
            damaged = data.draw(st.binary(max_size=64).filter(lambda b: b != original))
        path.write_bytes(damaged)
        with pytest.raises(CorruptBlob, match=key):
            store.get(key)
        with pytest.raises(CorruptBlob):
            store.recall("v")


def test_a_binding_that_is_not_a_stores_is_corrupt_whatever_it_holds(tmp_path: Path) -> None:
    from somatize.codecs import encode

    store = Store(tmp_path)
    store.keep("x", 1)
    binding = tmp_path / "names" / "x" / ".bind"
    for hostile in (
        encode({"name": "x", "digest": "../../../../etc/passwd", "meta": [], "when": 0.0}),
        encode({"name": 1, "digest": "sha256:" + "0" * 64, "meta": [], "when": 0.0}),
        encode({"name": "x", "digest": "sha256:" + "0" * 64, "meta": [(1, 2)], "when": 0.0}),
        encode([1, 2, 3]),
        b"\xc8\x03\x8b\x01\x91" * 200,
    ):
        binding.write_bytes(hostile)
        with pytest.raises(CorruptBinding, match="'x'"):
            store.resolve("x")
        with pytest.raises(CorruptBinding):
            store.recall("x")


@pytest.mark.parametrize("kind", ["directory", "fsspec dir://"])
def test_temp_files_of_writers_elsewhere_go_once_silent_past_older_than(
    tmp_path: Path, kind: str
) -> None:
    if kind == "directory":
        store = Store(tmp_path)
    else:  # an fsspec filesystem that is not an object store: writes go aside there too
        store = Store("dir::file:///store", dir={"path": str(tmp_path)})
    store.keep("x", 1)
    (folder,) = [p.parent for p in tmp_path.rglob(".bind")]
    old, fresh = folder / ".tmp-from-elsewhere", folder / ".tmp-from-elsewhere-too"
    old.write_bytes(b"a" * 10)
    fresh.write_bytes(b"b" * 5)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert store.clean(older_than=3600) == {"files": 1, "bytes": 10}
    assert not old.exists() and fresh.exists()
    assert store.clean(older_than=0) == {"files": 1, "bytes": 5}
    assert store.recall("x") == 1


def blob_files(where: Path) -> list[Path]:
    return sorted(p for p in (where / "blobs").rglob("*") if p.is_file())


def age(paths: list[Path], seconds: float = 7200) -> None:
    for p in paths:
        os.utime(p, (time.time() - seconds, time.time() - seconds))


def test_clean_removes_a_blob_whose_name_could_not_be_written_once_old(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.keep("kept", "named")
    (named,) = blob_files(tmp_path)
    (tmp_path / "names" / "lost").write_bytes(b"")  # a file where the name's folder would go
    with pytest.raises(OSError):
        store.keep("lost", "orphan")
    (orphan,) = set(blob_files(tmp_path)) - {named}
    # a writer may be naming it
    assert store.clean(older_than=0, unnamed=True) == {"files": 0, "bytes": 0}
    age(blob_files(tmp_path))
    assert store.clean() == {"files": 0, "bytes": 0}  # unasked, no blob goes: it may be kept
    size = orphan.stat().st_size
    assert store.clean(unnamed=True) == {"files": 1, "bytes": size}
    assert blob_files(tmp_path) == [named] and store.recall("kept") == "named"
    # an old unnamed blob put again is new again: clean leaves it to the name it then gets
    key = store.put(b"late")
    age(blob_files(tmp_path))
    assert store.put(b"late") == key
    assert store.clean(unnamed=True) == {"files": 0, "bytes": 0}
    store.bind("late", key)
    age(blob_files(tmp_path))
    assert store.clean(unnamed=True) == {"files": 0, "bytes": 0} and store.get(key) == b"late"


def test_clean_removes_no_blob_while_a_binding_cannot_be_read(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.keep("x", 1)
    (binding,) = tmp_path.rglob(".bind")
    binding.write_bytes(b"torn")
    age(blob_files(tmp_path))
    assert store.clean(unnamed=True) == {"files": 0, "bytes": 0}
    assert len(blob_files(tmp_path)) == 1
