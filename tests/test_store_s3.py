"""A store on S3: moto's server on 127.0.0.1 for what S3 does, and a proxy in front of it
(tests/_s3race.py) for the one thing moto cannot show, that a claim is exactly-once."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from collections.abc import Iterator

import pytest
from _s3race import RacingS3
from moto.server import ThreadedMotoServer

from somatize import Store
from somatize.codecs import digest


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def racing(moto: str) -> Iterator[RacingS3]:
    with RacingS3(moto) as proxy:
        yield proxy


def s3_store(endpoint: str, bucket: str) -> Store:
    return Store(
        f"s3://{bucket}/prefix",
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": endpoint},
        skip_instance_cache=True,
    )


def test_an_s3_store_keeps_binds_and_claims(moto: str) -> None:
    store = s3_store(moto, "somatize-test")
    key = store.put(b"weights")
    assert store.get(key) == b"weights" and store.get(digest(b"other")) is None
    store.keep("run/r1/0", {"loss": 0.5, "shape": (2, 3)}, meta={"forward": 0})
    assert store.recall("run/r1/0") == {"loss": 0.5, "shape": (2, 3)}
    assert store.resolve("run/r1/0").meta == [("forward", 0)]
    assert store.claim("fed/round/0", key) is True
    assert store.claim("fed/round/0", digest(b"late")) is False
    # a second client (its own filesystem object and cache) sees the bindings and loses claims
    other = s3_store(moto, "somatize-test")
    assert [b.name for b in other.bound()] == ["fed/round/0", "run/r1/0"]
    assert other.claim("fed/round/0", digest(b"late")) is False
    assert other.resolve("fed/round/0").digest == key
    again = pickle.loads(pickle.dumps(other))
    assert again.recall("run/r1/0")["shape"] == (2, 3)
    assert store.clean() == {"files": 0, "bytes": 0}  # nothing is written aside on S3


def test_removing_unnamed_blobs_is_refused_on_s3_not_skipped(moto: str) -> None:
    store = s3_store(moto, "somatize-unnamed")
    key = store.put(b"kept by digest, named by nothing")
    with pytest.raises(ValueError, match=r"clean\(unnamed=True\).*directory.*'s3://.*clean\(\)"):
        store.clean(older_than=0, unnamed=True)  # an S3 object's age is not made new by a put
    assert store.get(key) == b"kept by digest, named by nothing"


def test_a_409_is_asked_again_and_the_claim_then_won(racing: RacingS3) -> None:
    store = s3_store(racing.endpoint, "somatize-409-won")
    key = store.put(b"mine")
    racing.conflicts = 3  # three answers of "another conditional write is in flight"
    assert store.claim("fed/round/0/averager", key, {"who": 1}) is True
    assert racing.answered[409] == 3 and racing.answered[200] == 1
    bound = s3_store(racing.endpoint, "somatize-409-won").resolve("fed/round/0/averager")
    assert bound.digest == key and bound.meta == [("who", 1)]


def test_a_409_whose_write_then_lands_is_a_lost_claim_not_an_error(racing: RacingS3) -> None:
    import fsspec

    store = s3_store(racing.endpoint, "somatize-409-lost")
    racing.conflicts, racing.land = 1, b"the other client's binding"
    assert store.claim("x", store.put(b"mine")) is False
    fs = fsspec.filesystem(
        "s3",
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": racing.endpoint},
        skip_instance_cache=True,
    )
    assert fs.cat_file("somatize-409-lost/prefix/names/x/.bind") == b"the other client's binding"


def _claimer(endpoint: str, barrier: object, mine: int, rounds: int, results: object) -> None:
    store = s3_store(endpoint, "somatize-race")
    key = store.put(f"client {mine}".encode())
    for r in range(rounds):
        barrier.wait(timeout=120)  # type: ignore[attr-defined]
        try:
            won = store.claim(f"race/{r}", key, {"who": mine})
        except Exception as error:  # noqa: BLE001  (an error is what this test looks for)
            won = repr(error)
        results.put((r, mine, won))  # type: ignore[attr-defined]


def test_exactly_one_of_eight_processes_wins_each_race_through_real_conflicts(
    racing: RacingS3,
) -> None:
    """Eight processes claim the same name at a barrier, three times. The proxy lets one
    conditional put of a name through at a time (held 0.3 s) and answers the others 409, as
    S3 does; moto then decides 200 or 412. Exactly one claimer wins each race, and nobody
    sees an error."""
    racing.hold = 0.3
    context = multiprocessing.get_context("spawn")
    barrier, results, rounds = context.Barrier(8), context.Queue(), 3
    workers = [
        context.Process(target=_claimer, args=(racing.endpoint, barrier, i, rounds, results))
        for i in range(8)
    ]
    for worker in workers:
        worker.start()
    try:
        answers = [results.get(timeout=180) for _ in range(8 * rounds)]
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.exitcode is None:
                worker.kill()
    assert all(worker.exitcode == 0 for worker in workers)
    assert [a for a in answers if not isinstance(a[2], bool)] == []
    store = s3_store(racing.endpoint, "somatize-race")
    for r in range(rounds):
        winners = [mine for round_, mine, won in answers if round_ == r and won]
        assert len(winners) == 1, (r, winners)
        assert store.resolve(f"race/{r}").meta == [("who", winners[0])]
    assert racing.answered[409] > 0  # the races were real: claimers met a write in flight


def test_threads_of_one_process_claim_exactly_once_on_s3(moto: str) -> None:
    store = s3_store(moto, "somatize-threads")
    keys = [store.put(f"t{i}".encode()) for i in range(8)]
    barrier, won = threading.Barrier(8), []

    def claim(i: int) -> None:
        barrier.wait()
        if store.claim("once", keys[i]):
            won.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and store.resolve("once").digest == keys[won[0]]
