"""Data parallel: steps per second through `Trainer(parallel="ddp")`, next to torch's DDP
written by hand, on 1 and 2 ranks, and the all-reduce's share of a step.

Run as it is, the script launches itself under torchrun on 127.0.0.1, with 1 and then 2
ranks, and reports what rank 0 measured. On
CPU the ranks use gloo and one thread each; where a GPU is, the same script runs NCCL, one
rank per GPU (2 ranks only with 2 GPUs). Per world size, measured in the same run,
interleaved, medians of repeats:

- torch: a hand loop over `DistributedDataParallel(nn.Sequential(...))`, as a user writes it
  (zero_grad, forward, loss, backward, step, `.item()`), with `find_unused_parameters` off,
  and on (what the Trainer turns on, since a node may leave a branch untaken);
- the Trainer: `t.step(batch)` on the same layers as a graph, `parallel="ddp"`;
- the all-reduce's share: 1 − (a torch step under `no_sync`) / (a torch step), what the
  gradients' all-reduce adds to a step once DDP has overlapped what it can with the backward.

    python bench/parallel.py            # prints a markdown table
    python bench/parallel.py --results  # and rewrites its section of bench/RESULTS.md
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH, DEPTH, BATCH = 256, 4, 32  # per rank
LOOPS, REPEATS = 20, 15


def _graph(device: str) -> Any:
    from train import Dense  # bench/train.py's layer node

    from somatize import Graph

    torch.manual_seed(0)
    expr = Dense(WIDTH, WIDTH).named("d0").on(device)
    for k in range(1, DEPTH):
        expr = expr >> Dense(WIDTH, WIDTH, relu=k < DEPTH - 1).named(f"d{k}").on(device)
    return Graph.somatize(expr)


def _hand(device: str, find_unused: bool) -> tuple[Any, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(DEPTH):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if k < DEPTH - 1:
            layers.append(nn.ReLU())
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*layers).to(device), find_unused_parameters=find_unused
    )
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _time_us(fn: Any, loops: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter_ns()
    for _ in range(loops):
        fn()
    sync()
    return (time.perf_counter_ns() - t0) / loops / 1e3


def rank_main(out: str) -> None:
    """One rank: measure, and on rank 0 write the medians to `out`."""
    import torch.distributed as dist

    from somatize.torch import Trainer, parameters

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" is this rank's GPU
    else:
        torch.set_num_threads(1)
    loss = nn.functional.mse_loss
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x = torch.randn(BATCH, WIDTH, generator=gen).to(device)
    y = torch.randn(BATCH, WIDTH, generator=gen).to(device)

    g = _graph(device)
    t = Trainer(
        g, objective=loss, optimizer=torch.optim.SGD(parameters(g), lr=1e-3), parallel="ddp"
    )  # joins the group
    hands = {"torch": _hand(device, False), "torch_unused": _hand(device, True)}

    def hand(model: Any, opt: Any, sync: bool = True) -> float:
        opt.zero_grad()
        with contextlib.nullcontext() if sync else model.no_sync():
            value = loss(model(x), y)
            value.backward()
        opt.step()
        return value.item()

    runs = {
        "torch": lambda: hand(*hands["torch"]),
        "torch_unused": lambda: hand(*hands["torch_unused"]),
        "torch_no_sync": lambda: hand(*hands["torch"], sync=False),
        "trainer": lambda: t.step((x, y)),
    }
    for fn in runs.values():  # warm up
        _time_us(fn, LOOPS)
    seen: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(REPEATS):
        for k, fn in runs.items():
            dist.barrier()
            seen[k].append(_time_us(fn, LOOPS))
    if dist.get_rank() == 0:
        medians = {k: statistics.median(v) for k, v in seen.items()}
        medians["backend"] = dist.get_backend()
        Path(out).write_text(json.dumps(medians))


def launch(world: int, limit: float = 600) -> dict[str, Any]:
    """Run `world` ranks of this script under torchrun, on 127.0.0.1; answer what rank 0
    measured."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}"]
        run += ["--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--rank", out]
        path = os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])
        subprocess.run(run, env={**os.environ, "PYTHONPATH": path}, timeout=limit, check=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    from _results import report

    gpus = torch.cuda.device_count()
    worlds = [1, 2] if gpus in (0, 2) or gpus > 2 else [1]
    rows = []
    for world in worlds:
        m = launch(world)
        per_s = {k: 1e6 / m[k] for k in ("torch", "torch_unused", "trainer")}
        share = max(0.0, 1 - m["torch_no_sync"] / m["torch"])
        rows.append(
            [
                world,
                f"{m['backend']}, {'GPU' if gpus else 'CPU'}",
                round(per_s["torch"]),
                round(per_s["torch_unused"]),
                round(per_s["trainer"]),
                per_s["trainer"] / per_s["torch"],
                per_s["trainer"] / per_s["torch_unused"],
                share,
            ]
        )
    report(
        "parallel",
        f"steps/s through Trainer(parallel='ddp') and torch's DDP by hand "
        f"({DEPTH} × Linear({WIDTH}, {WIDTH}), batch {BATCH} a rank)",
        [
            "ranks",
            "backend",
            "torch DDP steps/s",
            "torch DDP, find_unused steps/s",
            "Trainer steps/s",
            "Trainer / torch",
            "Trainer / torch find_unused",
            "all-reduce share of a torch step",
        ],
        rows,
        notes="Each rank one thread on CPU. The Trainer turns find_unused_parameters on (a node "
        "may leave a branch untaken); the all-reduce's share is 1 − (step under no_sync) / step.",
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2])
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        main()
