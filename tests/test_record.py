"""somatize.record: a Recorder writes one record per forward; a run reads back as DataFrames."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from somatize import Graph, Node, Recorder, Store, health
from somatize import record as rec
from somatize.codecs import NoCodec, decode, digest, encode


class Inc(Node):
    def forward(self, input: Any, ctx: Any) -> Any:
        return input + 1


class Double(Node):
    def forward(self, input: Any, ctx: Any) -> Any:
        return input * 2


def step(recorder: Recorder, i: int, *, health: bool = True) -> None:
    """What a Trainer told its watchers in one step, in the order it tells them, with a
    health fact in the layout records were written in before facts were flat."""
    recorder({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 10.0 + i})
    recorder({"fact": "ran", "node": "head", "began_us": 10.0, "took_us": 5})
    recorder({"fact": "finished", "took_us": 20.5})
    recorder({"fact": "loss", "value": 1.0 / (i + 1), "step": i})
    recorder({"fact": "updated", "step": i})
    if health:
        numbers = {"grad_norm": 0.5 * i, "dead_channels": i, "nan": False}
        recorder({"fact": "health", "where": "enc.fc", "step": i, "numbers": numbers})
    recorder.flush()


def test_one_record_per_forward_readable_with_recall(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="r1")
    for i in range(3):
        step(recorder, i)
    facts = store.recall("run/r1/1")
    assert [f["fact"] for f in facts] == ["ran", "ran", "finished", "loss", "updated", "health"]
    assert facts[3] == {"fact": "loss", "value": 0.5, "step": 1}
    assert type(facts[1]["took_us"]) is int and facts[5]["numbers"]["nan"] is False
    bound = store.resolve("run/r1/2")
    assert bound.meta == [
        ("run", "r1"),
        ("forward", 2),
        ("state", "ok"),
        ("nodes", 2),
        ("took_us", 20.5),
    ]
    assert store.recall("run/r1/3") is None


def test_a_record_is_written_at_finished_and_completed_later(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="r")
    recorder({"fact": "ran", "node": "a", "began_us": 0.0, "took_us": 1.0})
    assert store.recall("run/r/0") is None
    recorder({"fact": "finished", "took_us": 2.0})
    assert [f["fact"] for f in store.recall("run/r/0")] == ["ran", "finished"]
    recorder({"fact": "loss", "value": 0.25, "step": 0})
    assert len(store.recall("run/r/0")) == 2  # not yet: written at the next forward or flush
    recorder({"fact": "ran", "node": "a", "began_us": 0.0, "took_us": 1.0})
    assert store.recall("run/r/0")[-1] == {"fact": "loss", "value": 0.25, "step": 0}
    recorder.close()
    assert store.resolve("run/r/1").get("state") == "unfinished"
    assert recorder.forwards == 2


def test_a_graph_watched_by_a_recorder(tmp_path: Path) -> None:
    store = Store(tmp_path)
    graph = Graph.somatize(Inc().named("inc") >> Double().named("dbl"))
    recorder = Recorder(store)
    assert recorder.run
    for x in range(4):
        assert graph.forward(x, watching=recorder) == (x + 1) * 2
    recorder.close()
    assert rec.runs(store)["run"].tolist() == [recorder.run]
    timings = rec.timings(store, recorder.run)
    assert list(timings.columns) == ["forward", "node", "began_us", "took_us"]
    assert timings["forward"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert timings["node"].tolist() == ["inc", "dbl"] * 4
    assert (timings["took_us"] >= 0).all()
    assert store.resolve(f"run/{recorder.run}/3").get("nodes") == 2


def test_facts_read_back_with_their_types(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="typed")
    for i in range(3):
        step(recorder, i)
    table = rec.facts(store, "typed")
    assert list(table.columns[:8]) == [
        "fact",
        "forward",
        "node",
        "began_us",
        "took_us",
        "value",
        "step",
        "where",
    ]
    assert len(table) == 18
    assert table["forward"].dtype == "int64"
    assert table["step"].dtype == "Int64"
    assert table["grad_norm"].dtype == "float64"
    assert table["dead_channels"].dtype == "Int64"
    assert table["nan"].dtype == "boolean"
    health = table[table["fact"] == "health"]
    assert health["where"].tolist() == ["enc.fc"] * 3
    assert health["dead_channels"].tolist() == [0, 1, 2]
    assert health["nan"].tolist() == [False, False, False]


def test_numpy_values_read_back_scalars_as_numbers_and_arrays_as_they_are(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    with Recorder(store, run="np") as recorder:
        recorder({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 1.0})
        recorder({"fact": "finished", "took_us": 2.0})
        recorder({"fact": "loss", "value": np.float32(0.5), "step": np.int64(3)})
        recorder({"fact": "probe", "value": np.array([1.0, 2.0]), "step": 4})
    table = rec.facts(store, "np")
    assert table["step"].tolist()[2:] == [3, 4]
    loss, probe = table["value"].tolist()[2:]
    assert loss == 0.5 and type(loss) is float
    assert isinstance(probe, np.ndarray) and probe.tolist() == [1.0, 2.0]
    assert rec.curve(store, "np", "probe")["value"].tolist()[0].tolist() == [1.0, 2.0]


def test_a_facts_own_forward_is_kept_beside_the_records(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with Recorder(store, run="cut") as recorder:
        for i in range(2):
            step(recorder, i, health=False)
            recorder({"fact": "crossed", "step": i, "forward": 1000 + i, "backward": 7})
    table = rec.facts(store, "cut")
    crossed = table[table["fact"] == "crossed"]
    assert crossed["forward"].tolist() == [0, 1]  # the record it is in
    assert crossed["crossed.forward"].tolist() == [1000, 1001]  # the bytes it says went forward
    assert crossed["backward"].tolist() == [7, 7]


def test_losses_are_the_loss_curve(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="curve")
    for i in range(4):
        step(recorder, i, health=False)
    losses = rec.losses(store, "curve")
    assert list(losses.columns) == ["step", "loss"]
    assert losses["step"].dtype == "int64"
    assert losses["step"].tolist() == [0, 1, 2, 3]
    assert losses["loss"].tolist() == pytest.approx([1.0, 0.5, 1 / 3, 0.25])


def test_summarising_adds_meta_and_may_not_overwrite(tmp_path: Path) -> None:
    store = Store(tmp_path)

    def slowest(facts: list[dict[str, Any]]) -> dict[str, Any]:
        ran = [f for f in facts if f["fact"] == "ran"]
        return {"slowest": max(ran, key=lambda f: f["took_us"])["node"]}

    recorder = Recorder(store, run="s", summarising=slowest)
    step(recorder, 0)
    assert store.resolve("run/s/0").get("slowest") == "enc"
    bad = Recorder(store, run="bad", summarising=lambda facts: {"state": "mine"})
    with pytest.raises(ValueError, match="state"):
        bad({"fact": "finished", "took_us": 1.0})
    when = Recorder(store, run="when", summarising=lambda facts: {"when": "tuesday"})
    with pytest.raises(ValueError, match=r"may not overwrite the record's own meta \['when'\]"):
        when({"fact": "finished", "took_us": 1.0})  # forwards() has a column of that name


def test_a_refused_summary_leaves_nothing_in_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path)
    finished = {"fact": "finished", "took_us": 1.0}
    kept = digest(encode([finished]))  # what the record would hold
    asked = []

    def summary(facts: list[dict[str, Any]]) -> dict[str, Any]:
        asked.append(len(facts))
        return {"best": 1}

    refusals = (({"state": "mine"}, ValueError), ({"bad": object()}, NoCodec), ({5: 1}, TypeError))
    for said, error in refusals:
        refused = Recorder(store, run="refused", summarising=lambda facts, said=said: said)
        with pytest.raises(error, match="state|meta"):
            refused(dict(finished))
        assert store.get(kept) is None and store.names() == []
    taken = Recorder(store, run="taken", summarising=summary)
    store.keep("run/taken/0", [])  # another writer claims forward 0 first: 1 is claimed
    taken(dict(finished))
    bound = store.resolve("run/taken/1")
    assert bound.get("forward") == 1 and bound.get("best") == 1 and asked == [1]  # asked once


def within(seconds: float, work: Callable[[], Any]) -> Any:
    """What `work()` answers (or raises), run in a thread that must end within `seconds`."""
    answer: list[Any] = []

    def run() -> None:
        try:
            answer.append((True, work()))
        except BaseException as error:  # handed to the test's thread
            answer.append((False, error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert answer, f"still running after {seconds} s: a deadlock"
    ok, value = answer[0]
    if not ok:
        raise value
    return value


def test_a_summariser_may_read_its_recorder_and_may_not_feed_it(tmp_path: Path) -> None:
    store = Store(tmp_path)
    graph = Graph.somatize(Inc().named("inc") >> Double().named("dbl"))
    recorder = Recorder(
        store,
        run="read",
        summarising=lambda facts: {"seen": recorder.forwards, "as": repr(recorder)},
    )
    for x in range(3):
        assert within(10, lambda x=x: graph.forward(x, watching=recorder)) == (x + 1) * 2
    within(10, recorder.close)
    table = rec.forwards(store, "read")
    assert table["seen"].tolist() == [1, 2, 3] and "forwards=3" in table["as"].iloc[-1]

    def feeding(feed: Callable[[Recorder], Any]) -> Recorder:
        fed = Recorder(store, run="fed", summarising=lambda facts: feed(fed) or {})
        return fed

    for feed in (lambda r: r.flush(), lambda r: r({"fact": "loss", "value": 1.0})):
        fed = feeding(feed)
        with pytest.raises(RuntimeError, match=r"summarising= callable of run 'fed'.*facts"):
            within(10, lambda fed=fed: graph.forward(1, watching=fed))


def test_runs_are_listed_oldest_first_and_unknown_runs_refused(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for run in ("zeta", "alpha"):
        step(Recorder(store, run=run), 0)
    store.keep("cache/ab/x", 1)
    assert rec.runs(store)["run"].tolist() == ["zeta", "alpha"]
    with pytest.raises(LookupError, match="zeta"):
        rec.facts(store, "nope")


def test_names_a_recorder_cannot_write_are_not_runs_and_odd_times_read_as_nat(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    step(Recorder(store, run="good"), 0)
    store.keep("run/good/\u00b2", [])  # a digit to str.isdigit, not to int()
    store.keep("run/good/-1", [])
    climbing = tmp_path / "names" / "run" / "%2E%2E" / "0"  # '..', put there by hand
    climbing.mkdir(parents=True)
    (climbing / ".bind").write_bytes(
        (tmp_path / "names" / "run" / "good" / "0" / ".bind").read_bytes()
    )
    assert rec.runs(store)["run"].tolist() == ["good"]
    assert rec.forwards(store, "good")["forward"].tolist() == [0]
    assert [i for i, _ in rec.records(store, "good")] == [0]
    # a binding written with a time no clock gives is a row whose time is unknown
    (binding,) = (tmp_path / "names" / "run" / "good" / "0").glob(".bind")
    fields = decode(binding.read_bytes())
    binding.write_bytes(encode({**fields, "when": 1e300}))
    assert rec.runs(store)["first"].isna().tolist() == [True]
    assert rec.forwards(store, "good")["when"].isna().tolist() == [True]


@pytest.mark.parametrize("held", [5, {"fact": "loss"}, ["loss"]])
def test_a_record_that_is_not_a_list_of_facts_is_refused_by_name(tmp_path: Path, held) -> None:
    store = Store(tmp_path)
    step(Recorder(store, run="r"), 0)
    store.keep("run/r/1", held)
    for read in (rec.records, rec.facts, lambda s, r: health.seen(s, run=r)):
        with pytest.raises(ValueError, match=r"record 'run/r/1' of run 'r' holds a"):
            read(store, "r")


def test_recorder_refuses_bad_runs_and_bad_facts(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Recorder(tmp_path, run="a/b")
    recorder = Recorder(str(tmp_path), run="ok")
    assert isinstance(recorder.store, Store)
    with pytest.raises(TypeError):
        recorder("ran")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        recorder({"node": "x"})


def test_empty_tables_have_their_columns(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="quiet")
    recorder({"fact": "finished", "took_us": 1.0})
    assert list(rec.losses(store, "quiet").columns) == ["step", "loss"]
    assert isinstance(rec.timings(store, "quiet"), pd.DataFrame)
    assert rec.timings(store, "quiet").empty


def flat_step(recorder: Recorder, i: int) -> None:
    """A step as the Trainer tells it now: flat health facts, one per watched place."""
    recorder({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 10.0 + i})
    recorder({"fact": "ran", "node": "head", "began_us": 10.0, "took_us": 5.0})
    recorder({"fact": "finished", "took_us": 20.5})
    recorder({"fact": "loss", "value": 1.0 / (i + 1), "step": i})
    recorder({"fact": "updated", "step": i})
    for inside in ("fc", None):
        recorder(
            {
                "fact": "health",
                "node": "enc",
                "inside": inside,
                "step": i,
                "grad_norm": 0.5 * i,
                "dead_channels": i,
                "nan": False,
            }
        )
    recorder.flush()


def test_flat_health_facts_read_back_by_metric_and_place(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="flat")
    for i in range(3):
        flat_step(recorder, i)
    table = rec.facts(store, "flat")
    health = table[table["fact"] == "health"]
    assert health["where"].tolist() == ["enc.fc", "enc"] * 3
    assert health["inside"].tolist()[:2] == ["fc", None]
    assert health["grad_norm"].tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert table["dead_channels"].dtype == "Int64" and table["nan"].dtype == "boolean"


def test_summarising_names_facts_and_every_record_carries_their_last_value(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="tuesday", summarising=["loss"])
    for i in range(3):
        flat_step(recorder, i)
    recorder({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 1.0})
    recorder({"fact": "finished", "took_us": 2.0})  # a forward without a loss
    recorder.close()
    values = [store.resolve(f"run/tuesday/{i}").get("loss.value") for i in range(4)]
    assert values == [1.0, 0.5, 1 / 3, None]
    assert store.resolve("run/tuesday/3").get("state") == "ok"
    one = Recorder(store, run="one", summarising="loss")  # a single name is a name too
    flat_step(one, 0)
    assert store.resolve("run/one/0").get("loss.value") == 1.0
    with pytest.raises(TypeError, match="names of facts"):
        Recorder(store, summarising=[1])
    with pytest.raises(TypeError, match="names of facts"):
        Recorder(store, summarising=[])


class Fragile(Node):
    def forward(self, input: Any, ctx: Any) -> Any:
        if input > 10:
            raise ValueError(f"{input} is too big")
        return input


def test_a_forward_that_broke_is_its_own_record(tmp_path: Path) -> None:
    store = Store(tmp_path)
    graph = Graph.somatize(Inc().named("inc") >> Fragile().named("fragile"))
    recorder = Recorder(store, run="b")
    assert graph.forward(1, watching=recorder) == 2
    with pytest.raises(ValueError, match="too big"):
        graph.forward(20, watching=recorder)  # inc ran, fragile raised: no finished fact
    assert graph.forward(2, watching=recorder) == 3
    recorder.close()
    states = [store.resolve(f"run/b/{i}").get("state") for i in range(3)]
    assert states == ["ok", "broke", "ok"]
    assert [[f["fact"] for f in facts] for _, facts in rec.records(store, "b")] == [
        ["ran", "ran", "finished"],
        ["ran"],
        ["ran", "ran", "finished"],
    ]
    assert rec.runs(store)["broke"].tolist() == [1]


def test_a_broken_forward_flushed_as_unfinished_reads_broke_once_the_next_begins(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    graph = Graph.somatize(Inc().named("inc") >> Fragile().named("fragile"))
    with Recorder(store, run="b") as recorder:
        with pytest.raises(ValueError, match="too big"):
            graph.forward(20, watching=recorder)
    assert store.resolve("run/b/0").get("state") == "unfinished"  # nothing came after it yet
    assert graph.forward(2, watching=recorder) == 3
    recorder.close()
    assert rec.forwards(store, "b")["state"].tolist() == ["broke", "ok"]


def test_runs_forwards_nodes_and_curve_are_dataframes(tmp_path: Path) -> None:
    store = Store(tmp_path)
    recorder = Recorder(store, run="tuesday", summarising=["loss"])
    for i in range(4):
        flat_step(recorder, i)
    recorder({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 1.0})
    recorder({"fact": "ran", "node": "enc", "began_us": 0.0, "took_us": 1.0})  # it broke
    recorder({"fact": "finished", "took_us": 3.0})
    recorder.close()
    step(Recorder(store, run="wednesday"), 0)

    table = rec.runs(store)
    assert list(table.columns) == ["run", "forwards", "broke", "took_us", "first", "last"]
    assert table["run"].tolist() == ["tuesday", "wednesday"]
    assert table["forwards"].tolist() == [6, 1] and table["broke"].tolist() == [1, 0]
    assert table["took_us"].tolist() == pytest.approx([4 * 20.5 + 3.0, 20.5])
    assert (
        str(table["first"].dtype).startswith("datetime64")
        and (table["first"] <= table["last"]).all()
    )

    per = rec.forwards(store, "tuesday")
    assert list(per.columns[:5]) == ["forward", "state", "nodes", "took_us", "when"]
    assert per["forward"].tolist() == list(range(6))
    assert per["state"].tolist() == ["ok"] * 4 + ["broke", "ok"]
    assert per["nodes"].tolist() == [2, 2, 2, 2, 1, 1]
    assert per["loss.value"].tolist()[:4] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert per["loss.value"].isna().tolist() == [False] * 4 + [True, True]

    who = rec.nodes(store, "tuesday")
    assert list(who.columns) == ["node", "ran", "took_us", "mean_us"]
    assert who["node"].tolist() == ["enc", "head"] and who["ran"].tolist() == [6, 4]
    assert who["took_us"].tolist() == pytest.approx([10 + 11 + 12 + 13 + 1 + 1, 20.0])

    losses = rec.curve(store, "tuesday")
    assert list(losses.columns) == ["forward", "step", "value"]
    assert losses["step"].tolist() == [0, 1, 2, 3] and losses["forward"].tolist() == [0, 1, 2, 3]
    assert losses["value"].tolist() == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert rec.curve(store, "tuesday", "updated")["step"].tolist() == [0, 1, 2, 3]
    with pytest.raises(LookupError, match="tuesday"):
        rec.forwards(store, "thursday")
    assert rec.runs(Store(tmp_path / "empty"))["run"].tolist() == []


def test_a_run_recorded_again_is_added_after_what_it_holds_never_written_over(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "store")
    first = Recorder(store, run="baseline", summarising=["loss"])
    for i in range(5):
        step(first, i)
    with pytest.warns(UserWarning, match=r"run 'baseline' already holds 5 record\(s\).*run="):
        again = Recorder(store, run="baseline", summarising=["loss"])
    for i in range(3):
        step(again, 10 + i)
    frame = rec.forwards(store, "baseline")
    assert frame["forward"].tolist() == list(range(8))
    assert frame["loss.value"].tolist() == [1 / (i + 1) for i in (0, 1, 2, 3, 4, 10, 11, 12)]
    assert rec.runs(store)["forwards"].tolist() == [8]


def test_two_processes_recording_one_run_at_once_keep_every_record(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        from somatize import Recorder, Store

        store, me = Store(sys.argv[1]), sys.argv[2]
        print("ready", flush=True)
        sys.stdin.readline()  # both start writing at once
        r = Recorder(store, run="shared")
        for i in range(40):
            r({"fact": "ran", "node": me, "began_us": 0.0, "took_us": float(i)})
            r({"fact": "finished", "took_us": 1.0})
        r.close()
        """
    )
    where = str(tmp_path / "store")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, where, who],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for who in ("a", "b")
    ]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    for child in children:
        child.wait(timeout=120)
        assert child.returncode == 0
    kept = rec.records(Store(where), "shared")
    assert [forward for forward, _ in kept] == list(range(80))
    said = sorted((facts[0]["node"], facts[0]["took_us"]) for _, facts in kept)
    assert said == sorted((who, float(i)) for who in "ab" for i in range(40))
