"""The process group a data-parallel Trainer trains in: joining it, and what the ranks tell
each other outside of DDP's own traffic, as tensors through torch.distributed's collectives
(JSON from rank 0, a yes or no from every rank; nothing is unpickled). A collective that fails
because another rank went away becomes a `RankLost` that says so.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

LAUNCHED_BY = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets
_MOST_JSON = 64 << 20  # what rank 0 may say in one message, in bytes
_LOST = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|broken pipe|timed? ?out|timeout", re.I
)


class RankLost(RuntimeError):
    """Another rank stopped answering in the middle of a collective (it died, or fell behind
    past the group's timeout): raised on the ranks still running instead of waiting for ever,
    saying what this rank was doing and what torch.distributed said."""


def rank_and_size() -> tuple[int, int]:
    """`(rank, world size)`: the open group's, else the launcher's environment's, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return 0, 1


def join(cuda: bool) -> None:
    """Open the process group (NCCL if `cuda`, with this rank's `LOCAL_RANK` GPU current,
    else gloo) from the launcher's environment, or use the one already open."""
    if not dist.is_available():
        raise RuntimeError(
            "parallel= trains through torch.distributed, and this torch was built without "
            "it: install a torch that has it, or leave parallel= out"
        )
    if cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        missing = [name for name in LAUNCHED_BY if not os.environ.get(name)]
        if missing:
            raise RuntimeError(
                f"parallel= trains one process per rank, and this process was not started as "
                f"one ({', '.join(missing)} not set): launch the script with "
                "`torchrun --nproc_per_node=2 train.py` (from a notebook, `!torchrun ...`), open "
                "the group yourself with torch.distributed.init_process_group, or leave "
                "parallel= out to train in this process"
            )
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(_leave)


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    """Where the group's tensors live: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def from_rank0(value: Any = None) -> Any:
    """What rank 0 passed (anything JSON can say), on every rank; the others pass nothing.
    Sent as bytes in a tensor, its length first: a bounded message and nothing that runs."""
    where = device()
    rank0 = dist.get_rank() == 0
    data = json.dumps(value).encode() if rank0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=where)
    dist.broadcast(size, 0)
    n = int(size.item())
    if not 0 < n <= _MOST_JSON:
        raise ValueError(f"rank 0 sent a message of {n} bytes; at most {_MOST_JSON} are read")
    if rank0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(where)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=where)
    dist.broadcast(buf, 0)
    return json.loads(buf.cpu().numpy().tobytes())


def gathered(value: int) -> list[int]:
    """Every rank's `value` (an int), in rank order, the same list on every rank."""
    mine = torch.tensor([value], dtype=torch.int64, device=device())
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(v.item()) for v in every]


def refusing(ok: bool) -> list[int]:
    """Every rank says whether it agrees; answers the ranks that did not (the same list on
    every rank), so all of them can refuse together rather than some waiting on the rest."""
    return [r for r, flag in enumerate(gathered(0 if ok else 1)) if flag]


def _lost(error: BaseException) -> bool:
    if isinstance(error, RankLost):
        return False
    error_type = getattr(dist, "DistError", None)
    if error_type is not None and isinstance(error, error_type):
        return True
    return type(error) is RuntimeError and bool(_LOST.search(str(error)))


@contextlib.contextmanager
def answering(doing: str) -> Iterator[None]:
    """Run a step that waits on the other ranks: a collective that failed because one went away
    comes out as a `RankLost` naming what this rank was `doing`; other errors as they were."""
    try:
        yield
    except RuntimeError as error:
        if not _lost(error):
            raise
        rank, size = rank_and_size()
        said = str(error).strip().splitlines()[0][:300] if str(error).strip() else repr(error)
        raise RankLost(
            f"rank {rank} of {size}, {doing}: another rank stopped answering "
            f"(torch.distributed: {said}). A rank died or fell behind, and its own output says "
            "why; every rank has to take the same steps on as many batches (give each its "
            "share with somatize.torch.shard)"
        ) from error
