"""Weights and gradients between the ranks, outside of DDP's own traffic: rank 0's weights
sent to every rank, and a group's gradients averaged when no backward is left to do it. Tensors
go by broadcast and all-reduce, what describes them as JSON from rank 0; nothing is unpickled.
That description (`manifest`) and how two of them differ (`difference`) are also how federated
averaging checks the exports it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from somatize.torch.training import _ranks
from somatize.torch.training.params import state_of

_DTYPES = {
    f"torch.{name}": getattr(torch, name)
    for name in (
        "float16 bfloat16 float32 float64 complex64 complex128 uint8 int8 int16 int32 int64 bool"
    ).split()
}
"""The dtypes rank 0's weights are sent in, by `str(dtype)`, and the only ones a rank takes
from rank 0's description: a list of its own, not the wire's, which may grow apart."""


def _sent(tensor: torch.Tensor) -> torch.Tensor:
    """Broadcast `tensor` from rank 0 into itself on the others, through a copy where the
    backend cannot take it as it is."""
    where = _ranks.device()
    wire = tensor.detach()
    if wire.dtype is torch.bool:
        wire = wire.to(torch.uint8)
    if wire.device != where or not wire.is_contiguous():
        wire = wire.to(where).contiguous()
    dist.broadcast(wire, 0)
    if wire.data_ptr() != tensor.data_ptr():
        with torch.no_grad():
            tensor.copy_(wire)
    return tensor


def broadcast_states(graph: Any) -> None:
    """Every node's parameters and buffers made rank 0's, on every rank (what DDP's
    constructor does for the modules it wraps, done once for the whole graph)."""
    for nid in graph.nodes():
        for tensor in state_of(graph.implementation(nid)).values():
            if not hasattr(tensor, "to_local"):  # an FSDP shard is each rank's own
                _sent(tensor)


def average_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Each parameter's gradient replaced by its mean over the ranks, as DDP's backward would
    make it (None where no rank has one, zero where some rank lacks one), one all-reduce per
    (dtype, device)."""
    params = [p for p in params if p.requires_grad]
    where = _ranks.device()
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=where)
    dist.all_reduce(had, op=dist.ReduceOp.MAX)
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p, flag in zip(params, had.tolist(), strict=True):
        if flag:
            groups.setdefault((p.dtype, p.device), []).append(p)
    for (_, device), group in groups.items():
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group]
        ).to(where)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, piece in zip(group, flat.split([q.numel() for q in group]), strict=True):
            mean = piece.view_as(p).to(device)
            if p.grad is None:
                p.grad = mean.clone()
            else:
                p.grad.copy_(mean)


def manifest(weights: Any) -> dict[str, list]:
    """`{node: [[key, str(dtype), shape], ...]}`, in their order, describing weights of the form
    `{node id: {key: tensor}}`; anything else is refused with a `TypeError` saying what and
    where (`it is a list, ...`, `node 'enc', 'w' is a float, not a tensor`)."""
    if not isinstance(weights, dict):
        raise TypeError(f"it is a {type(weights).__name__}, not {{node: {{key: tensor}}}}")
    nodes: dict[str, list] = {}
    for nid, given in weights.items():
        if not isinstance(nid, str) or not isinstance(given, dict):
            raise TypeError(f"its entry {nid!r:.60} is not a node id holding {{key: tensor}}")
        nodes[nid] = []
        for key, tensor in given.items():
            if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"node {nid!r}, {key!r:.60} is a {type(tensor).__name__}, not a tensor"
                )
            nodes[nid].append([key, str(tensor.dtype), list(tensor.shape)])
    return nodes


def difference(mine: dict[str, list], theirs: dict[str, list]) -> str | None:
    """How the weights `manifest` described as `mine` differ from `theirs` in nodes, keys,
    dtypes or shapes (in any order), or None when they hold the same."""
    if set(mine) != set(theirs):
        return f"it holds nodes {sorted(mine)}, not {sorted(theirs)}"
    for nid, entries in mine.items():
        here = {key: f"{dtype}{tuple(shape)}" for key, dtype, shape in entries}
        there = {key: f"{dtype}{tuple(shape)}" for key, dtype, shape in theirs[nid]}
        if set(here) != set(there):
            return f"node {nid!r} holds keys {sorted(here)}, not {sorted(there)}"
        for key, kind in here.items():
            if there[key] != kind:
                return f"node {nid!r}, {key!r} is {kind}, not {there[key]}"
    return None


def _sendable(weights: Any) -> dict[str, Any]:
    """What describes rank 0's weights, or why they cannot be sent."""
    try:
        nodes = manifest(weights)
    except TypeError as error:
        return {"refused": f"load: rank 0's weights cannot be sent: {error}; nothing was loaded"}
    for nid, entries in nodes.items():
        for key, dtype, _ in entries:
            if dtype not in _DTYPES:
                return {"refused": f"node {nid!r}, {key!r}: a {dtype} tensor cannot be sent"}
    return {"nodes": nodes}


def from_rank0(weights: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Rank 0's `weights` (`{node: {key: tensor}}`), on every rank: rank 0 answers its own,
    the others what it sent. Refused on every rank alike when rank 0's are not of that form."""
    said = _ranks.from_rank0(_sendable(weights) if dist.get_rank() == 0 else None)
    if "refused" in said:
        raise TypeError(said["refused"])
    mine = dist.get_rank() == 0
    where = _ranks.device()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for nid, entries in _checked(said["nodes"]).items():
        out[nid] = {}
        for key, dtype, shape in entries:
            if mine:
                tensor = weights[nid][key]
            else:
                tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=where)
            out[nid][key] = _sent(tensor)
    return out


def _checked(nodes: Any) -> dict[str, list]:
    """The manifest as rank 0 built it, or refused if it is not of that form."""
    ok = isinstance(nodes, dict) and all(
        isinstance(entries, list)
        and all(
            isinstance(e, list)
            and len(e) == 3
            and isinstance(e[0], str)
            and e[1] in _DTYPES
            and isinstance(e[2], list)
            and all(type(n) is int and n >= 0 for n in e[2])
            for e in entries
        )
        for entries in nodes.values()
    )
    if not ok:
        raise ValueError("rank 0 described its weights in a form that is not a manifest")
    return nodes
