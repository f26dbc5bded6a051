"""A worker's smallest workable --max-message, and its clients' sessions as their connections
come and go. Real worker processes, 127.0.0.1 only."""

from __future__ import annotations

import time

import pytest
import torch

from somatize import Broker, Graph, Worker

NODES = "_remote_nodes"


@pytest.mark.parametrize(("encrypt", "smallest"), [(False, 48), (True, 259)])
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


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_frame_of_max_message_bytes_is_taken_encrypted_or_not(encrypt):
    from _remote_nodes import Plus

    worker = Worker.spawn(["--max-message", "4096"], encrypt=encrypt, send=[NODES])
    try:
        with Broker.embedded({"w": worker}) as b:
            g = Graph.somatize(Plus(1.0).at("w"))
            for n in (1016, 1024):  # CURVE adds 33 bytes to a frame: 4064 and 4096 bytes
                out = g.forward(torch.zeros(n), broker=b)
                assert out.shape == (n,) and bool((out == 1).all())
            with pytest.raises(ValueError, match="larger --max-message"):
                g.forward(torch.zeros(1025), broker=b)
    finally:
        worker.stop()


def test_a_client_connecting_where_another_just_left_keeps_its_session():
    """A connection that closes, and a new one on the descriptor it freed (a worker's next
    descriptor is the lowest free one) before the worker's once-a-second look at closed
    connections: the new client's session is its own, and outlives the grace a session of a
    client that went away gets (10 s)."""
    from _remote_nodes import Plus

    worker = Worker.spawn(send=[NODES])
    kept: list[Broker] = []
    try:
        for k in range(6):
            gone = Broker.embedded({"w": Worker.at(worker.address, token=worker.token)})
            gone.request("w", {"op": "hello"}, deadline=20)
            gone.close()
            time.sleep(0.1)  # the worker has closed that connection: its descriptor is free
            b = Broker.embedded({"w": Worker.at(worker.address, token=worker.token)})
            assert Graph.somatize(Plus(k).at("w")).forward(torch.ones(1), broker=b).item() == k + 1
            kept.append(b)
        time.sleep(12.5)
        with Broker.embedded({"w": Worker.at(worker.address, token=worker.token)}) as asks:
            assert asks.request("w", {"op": "hello"}, deadline=20)["sessions"] == len(kept)
    finally:
        for b in kept:
            b.close()
        worker.stop()
