"""A worker's smallest workable --max-message. Real worker processes, 127.0.0.1 only."""

from __future__ import annotations

import pytest
import torch

from somatize import Broker, Graph, Worker

NODES = "_remote_nodes"


@pytest.mark.parametrize(("encrypt", "smallest"), [(False, 48), (True, 292)])
def test_a_max_message_too_small_for_any_request_is_refused_when_the_worker_starts(
    encrypt, smallest
):
    for size in ("0", str(smallest - 1)):
        with pytest.raises(RuntimeError, match="exited with code 1") as failed:
            Worker.spawn(["--max-message", size], encrypt=encrypt)
        said = f"--max-message {size} is too small"
        assert said in str(failed.value) and f"give {smallest} or more" in str(failed.value)
    worker = Worker.spawn(["--max-message", str(smallest)], encrypt=encrypt, send=[NODES])
    try:
        with Broker.embedded({"w": worker}) as b:
            # the smallest request of a session is answered, a larger one refused before it
            # is sent, saying what to do
            assert b.request("w", {"op": "hello"}, deadline=20)["max_message"] == smallest
            from _remote_nodes import Lin

            with pytest.raises(ValueError, match="larger --max-message"):
                Graph.somatize(Lin().at("w")).forward(torch.ones(4), broker=b)
    finally:
        worker.stop()
