"""A threshold, or a time a record keeps, may be any real number: numpy's as Python's."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from somatize.health import EXPLODING, Thresholds, verdict
from somatize.record import Recorder, nodes, runs


@pytest.mark.parametrize(
    "value", [np.float32(0.5), np.float64(0.5), np.float16(0.5), Fraction(1, 2)]
)
def test_a_threshold_is_any_real_number(value):
    t = Thresholds(grad_high=value)
    assert t.grad_high == 0.5 and type(t.grad_high) is float
    assert verdict({"grad_norm": 0.75}, t) == [EXPLODING]
    assert verdict({"grad_norm": 0.25}, t) == []
    assert Thresholds(grad_high=np.int64(3)).grad_high == 3.0


@pytest.mark.parametrize("value", [True, np.bool_(True), "0.5", 1j, None, np.array([0.5])])
def test_a_threshold_that_is_no_real_number_is_refused_by_name(value):
    with pytest.raises(TypeError, match="threshold grad_high is a number"):
        Thresholds(grad_high=value)


def test_a_numpy_time_is_added_up_as_a_python_one(tmp_path):
    rec = Recorder(tmp_path, run="r")
    for took in (np.float32(2.0), 4):
        rec({"fact": "ran", "node": "x", "took_us": took})
        rec({"fact": "finished", "took_us": np.float32(took * 2)})
    rec.close()
    assert runs(tmp_path)["took_us"].tolist() == [12.0]
    row = nodes(tmp_path, "r").iloc[0]
    assert (row["ran"], row["took_us"], row["mean_us"]) == (2, 6.0, 3.0)


def test_a_window_is_any_whole_number_and_nothing_else():
    from somatize.health import Verdicts, seen_in

    facts = [
        {"fact": "health", "node": "a", "step": k, "grad_norm": g}
        for k, g in enumerate([1.0, 5.0, 2.0])
    ]
    assert seen_in(facts, last=np.int64(1)) == seen_in(facts, last=1) == {"a": {"grad_norm": 2.0}}
    assert Verdicts(last=np.int32(2)).last == 2
    for bad in (True, 1.5, np.float64(2.0), "2", np.int64(0)):
        with pytest.raises(ValueError, match="last is a positive number of steps"):
            Verdicts(last=bad)
