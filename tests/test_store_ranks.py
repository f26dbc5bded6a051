"""A store under `Trainer(parallel=)`: the check that every rank sees what rank 0 keeps leaves
nothing in the store, a directory or S3 (moto on 127.0.0.1). One rank of a real gloo group on
127.0.0.1, in a process of its own, handed the store pickled."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from moto.server import ThreadedMotoServer

from somatize import Store

RANK = """
import pickle, sys, torch
from _nodes import Layer
from somatize import Graph
from somatize.torch import Trainer, parameters
g = Graph.somatize(Layer(4, 8).named("enc").frozen().cached() >> Layer(8, 2, False).named("head"))
store = pickle.loads(bytes.fromhex(sys.argv[1]))
opt = torch.optim.SGD(parameters(g), lr=0.1)
t = Trainer(g, objective=torch.nn.functional.mse_loss, optimizer=opt, store=store, parallel="ddp")
t.step((torch.ones(2, 4, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)))
"""


@pytest.fixture(params=["directory", "s3"])
def place(request, tmp_path) -> Iterator[tuple[Store, Any, str]]:
    """A store, and the filesystem and folder its files are in."""
    if request.param == "directory":
        yield Store(tmp_path), fsspec.filesystem("file"), str(tmp_path)
        return
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    said = dict(key="k", secret="s", client_kwargs={"endpoint_url": f"http://{host}:{port}"})
    yield Store("s3://ranks/p", **said), fsspec.filesystem("s3", **said), "ranks/p"
    server.stop()


def test_the_check_that_ranks_share_a_store_leaves_no_blob_in_it(place):
    store, fs, root = place
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = Path(__file__).parent
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), *sys.path])
    ran = subprocess.run(
        [sys.executable, "-c", RANK, pickle.dumps(store).hex()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    fs.invalidate_cache()
    blobs = [path.rsplit("/", 1)[1] for path in fs.find(f"{root}/blobs")]
    named = [b.digest.split(":")[1][2:] for b in store.bound()]
    assert len(named) == 1 and blobs == named  # the step's cached value, and nothing else
