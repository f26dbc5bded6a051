"""The fault trials behind the table in docs/store.md: `python bench/store.py --faults`.

Each trial attacks a real store the way bad luck or a hostile writer would (processes killed
by pid, claims raced at a barrier, bytes damaged or made up) and counts what held. Loopback
only; every process it starts is stopped by pid.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import msgpack

from somatize import Store
from somatize.codecs import encode
from somatize.store import CorruptBlob

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _children import DECODER, STUCK_CLAIMER, WRITER, tuples  # noqa: E402


def _writer(where: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, where, "1000000"], stdout=subprocess.PIPE
    )
    proc.stdout.readline()
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def kills_mid_keep(n: int) -> list[Any]:
    where = tempfile.mkdtemp()
    store = Store(where)
    torn = 0
    for _ in range(n):
        proc = _writer(where)
        time.sleep(random.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        _stop(proc)
        value = store.recall("big")
        if value is not None and value["payload"] != bytes([value["i"] % 256]) * 1_000_000:
            torn += 1
    left = sum(1 for p in Path(where).rglob(".tmp-*"))
    removed = store.clean()
    after = sum(1 for p in Path(where).rglob(".tmp-*"))
    return [
        "writer killed mid-keep (SIGKILL at a random moment)",
        n,
        f"{torn} torn values; {left} temp files left, clean() removed "
        f"{removed['files']} ({removed['bytes'] / 1e6:.0f} MB), {after} remain",
    ]


def live_writer_and_clean(n: int) -> list[Any]:
    where = tempfile.mkdtemp()
    store = Store(where)
    proc = _writer(where)
    touched = caught = 0
    try:
        for _ in range(n):
            for _ in range(2000):
                proc.send_signal(signal.SIGSTOP)
                live = sorted(Path(where).rglob(".tmp-*"))
                if live:
                    break
                proc.send_signal(signal.SIGCONT)
                time.sleep(0.003)
            caught += bool(live)
            store.clean(older_than=0)
            touched += sum(1 for p in live if not p.exists())
            proc.send_signal(signal.SIGCONT)
            time.sleep(random.uniform(0.0, 0.05))
    finally:
        _stop(proc)
    return [
        "clean(older_than=0) while a writer is stopped mid-write",
        n,
        f"caught mid-write {caught} times; {touched} live temp files touched",
    ]


def _claimer(where: str, options: dict, barrier: Any, mine: int, races: int, out: Any) -> None:
    store = Store(where, **options)
    key = store.put(f"client {mine}".encode())
    for r in range(races):
        barrier.wait(timeout=300)
        try:
            won: Any = store.claim(f"race/{r}", key)
        except Exception as error:  # noqa: BLE001  (counted)
            won = repr(error)
        out.put((r, won))


def claim_races(where: str, options: dict, procs: int, races: int) -> tuple[int, int]:
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(procs), context.Queue()
    workers = [
        context.Process(target=_claimer, args=(where, options, barrier, i, races, out))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    answers = [out.get(timeout=600) for _ in range(procs * races)]
    for w in workers:
        w.join(timeout=60)
        if w.exitcode is None:
            w.kill()
    once = sum(1 for r in range(races) if sum(1 for a in answers if a == (r, True)) == 1)
    errors = sum(1 for _, won in answers if not isinstance(won, bool))
    return once, errors


def local_races(procs: int, races: int) -> list[Any]:
    once, errors = claim_races(tempfile.mkdtemp(), {}, procs, races)
    return [
        f"claim raced by {procs} processes on a directory",
        races,
        f"{once} of {races} races had exactly one winner; {errors} errors",
    ]


def s3_races(procs: int, races: int) -> list[Any]:
    from _s3race import RacingS3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        with RacingS3(f"http://{host}:{port}", hold=0.1) as proxy:
            options = {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": proxy.endpoint},
                "skip_instance_cache": True,
            }
            once, errors = claim_races("s3://races/p", options, procs, races)
            conflicts = proxy.answered[409]
    finally:
        server.stop()
    return [
        f"claim raced by {procs} processes on S3 (moto behind a proxy deciding conditional "
        "puts as S3 does)",
        races,
        f"{once} of {races} races had exactly one winner; {errors} errors; "
        f"{conflicts} answers of 409 met and asked again",
    ]


def killed_claimers(n: int) -> list[Any]:
    where = tempfile.mkdtemp()
    store = Store(where)
    real_link = os.link

    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "no hard links")

    claimable = 0
    os.link = no_links
    try:
        for i in range(n):
            proc = subprocess.Popen(
                [sys.executable, "-c", STUCK_CLAIMER, where, f"name/{i}"], stdout=subprocess.PIPE
            )
            proc.stdout.readline()
            proc.send_signal(signal.SIGKILL)
            _stop(proc)
            claimable += store.claim(f"name/{i}", store.put(b"mine"))
    finally:
        os.link = real_link
    return [
        "claimer killed mid-claim, on a filesystem without hard links",
        n,
        f"{claimable} of {n} names claimable again at once",
    ]


def corrupt_blobs(n: int) -> list[Any]:
    where = tempfile.mkdtemp()
    store = Store(where)
    reported = 0
    for i in range(n):
        key = store.keep(f"v/{i}", {"i": i, "data": os.urandom(random.randint(1, 200))})
        hexed = key.split(":")[1]
        path = Path(where, "blobs", "sha256", hexed[:2], hexed[2:])
        data = bytearray(path.read_bytes())
        how = random.choice(["flip", "truncate", "append", "zero"])
        if how == "flip":
            data[random.randrange(len(data))] ^= random.randint(1, 255)
        elif how == "truncate":
            del data[random.randrange(len(data)) :]
        elif how == "append":
            data += os.urandom(random.randint(1, 8))
        else:
            data = bytearray(len(data))
        path.write_bytes(bytes(data))
        try:
            store.recall(f"v/{i}")
        except CorruptBlob:
            reported += 1
    return ["blob damaged on disk (bit flips, truncation, garbage)", n, f"{reported} reported"]


def hostile_names(n: int) -> list[Any]:
    pieces = ["..", ".", "", "/", "\\", "\x00", "%2e%2e", ".bind", ".tmp-x", "~", "a", "é", "\n"]
    top = tempfile.mkdtemp()
    root = Path(top, "store")
    store = Store(root)
    key = store.put(b"v")
    refused = kept = 0
    for _ in range(n):
        name = "".join(random.choice(pieces) for _ in range(random.randint(1, 12)))
        try:
            store.bind(name, key)
            kept += store.resolve(name).name == name
        except (ValueError, TypeError):
            refused += 1
    outside = [p for p in Path(top).rglob("*") if p != root and root not in p.parents]
    return [
        "hostile names ('..', '/', NUL, '%2e', '.bind', ...)",
        n,
        f"{refused} refused, {kept} kept and read back, {len(outside)} files outside the store",
    ]


def _made_up() -> bytes:
    how = random.choice(["random", "mangled", "nested"])
    if how == "random":
        return os.urandom(random.randint(0, 2000))
    if how == "mangled":
        data = bytearray(encode({"x": [1, 2.5, (3, "four")], "y": b"\x00" * 8}))
        for _ in range(random.randint(1, 4)):
            at = random.randrange(len(data))
            data[at] = random.randint(0, 255)
        return bytes(data[: random.randint(0, len(data))])
    data = os.urandom(random.randint(0, 16))
    for _ in range(random.randint(1, 300)):
        code = random.choice([1, 1, 1, 2, 3, 16, 17, 42])
        data = (
            msgpack.packb(msgpack.ExtType(code, data)) if random.random() < 0.7 else b"\x91" + data
        )
    return data


def hostile_bytes(n: int) -> list[Any]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DECODER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    answers = {"ok": 0, "refused": 0}
    try:
        for _ in range(n):
            data = _made_up()
            proc.stdin.write(struct.pack(">I", len(data)) + data)
            proc.stdin.flush()
            line = proc.stdout.readline().decode().strip()
            if not line:
                break
            answers[line.split()[0]] += 1
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    alive = "alive" if sum(answers.values()) == n else f"died (exit {proc.returncode})"
    return [
        "hostile bytes decoded (random, mangled encodings, extensions nested up to 300 deep)",
        n,
        f"{answers['refused']} refused, {answers['ok']} decoded, decoder {alive}",
    ]


def bad_records(rounds: int) -> list[Any]:
    import torch

    from somatize.torch import gather

    deep = tuples(195)
    bad: list[Any] = ["words", {"other": {"w": torch.zeros(2)}}, {"e": {"w": torch.zeros(3)}}]
    bad.append({"e": {"w": torch.full((2,), float("nan"))}})
    store = Store(tempfile.mkdtemp())
    completed, slowest = 0, 0.0
    warnings.simplefilter("ignore", RuntimeWarning)
    for r in range(rounds):
        kind = r % 5
        if kind < 4:
            store.keep(f"fed/round/{r}/client/2", bad[kind])
        else:
            store.bind(f"fed/round/{r}/client/2", store.put(deep))
        answers: dict[int, Any] = {}
        began = time.monotonic()

        def client(k: int, r: int = r, answers: dict[int, Any] = answers) -> None:
            mine = {"e": {"w": torch.full((2,), float(k))}}
            answers[k] = gather(store, mine, run="fed", round=r, clients=3, mine=k, asking=0.01)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        slowest = max(slowest, time.monotonic() - began)
        completed += len(answers) == 2 and torch.equal(answers[0]["e"]["w"], torch.full((2,), 0.5))
    return [
        "gather round with one bad record (not an export, other nodes, other shape, NaN, "
        "900 hostile bytes)",
        rounds,
        f"{completed} of {rounds} completed among the good clients, the slowest in "
        f"{slowest:.2f} s (within= is 600 s)",
    ]


def trials() -> list[list[Any]]:
    random.seed(0)
    return [
        kills_mid_keep(300),
        live_writer_and_clean(50),
        local_races(16, 50),
        s3_races(8, 20),
        killed_claimers(20),
        corrupt_blobs(400),
        hostile_names(2000),
        hostile_bytes(20_000),
        bad_records(20),
    ]
