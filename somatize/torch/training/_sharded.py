"""`parallel="fsdp"`: each node's modules sharded across the ranks with FSDP2's `fully_shard`.

FSDP gathers weights in a forward hook, so it shards what is called through `nn.Module.__call__`:
the modules a node holds, or the children of a node that is a module (the engine calls its
`forward`); the rest is left to the root around them all. Frozen weights are not sharded.
FSDP2's names are looked up where they are used: torch 2.4 and 2.5 have none of them, and this
module still imports there (parallel.py refuses parallel="fsdp" first, naming the release).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp
from torch.distributed import tensor as dtensor
from torch.distributed.device_mesh import init_device_mesh

from somatize.torch.placement import named_modules_of, trainable
from somatize.torch.training.params import state_of


def _shardable(node: Any) -> list[nn.Module]:
    found: list[nn.Module] = []
    for _, module in named_modules_of(node):
        inside = list(module.children()) if module is node else [module]
        found += [m for m in inside if trainable(m)]
    return found


def shard(root: nn.Module, graph: Any, optimizer: Any, *, cuda: bool) -> nn.Module:
    """The graph's modules sharded over the ranks (each node's, then `root`, the module
    holding them all whose forward runs the graph), the optimizer pointed at the sharded
    parameters; answers `root`."""
    before = dict(root.named_parameters())
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    for nid in graph.nodes():
        if not graph.setting(nid).frozen:
            for module in _shardable(graph.implementation(nid)):
                fsdp.fully_shard(module, mesh=mesh)
    frozen = {p for p in root.parameters() if not p.requires_grad}
    fsdp.fully_shard(root, mesh=mesh, ignored_params=frozen or None)
    after = dict(root.named_parameters())
    moved = {id(before[name]): after[name] for name in before if name in after}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
    return root


def laid_out(graph: Any, given: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Whole tensors (the same on every rank) cut into the shards of the weights they load into;
    what matches no sharded weight is left whole."""
    for nid, state in given.items():
        if nid not in graph:
            continue
        mine = state_of(graph.implementation(nid))
        for key, tensor in state.items():
            there = mine.get(key)
            if isinstance(there, dtensor.DTensor) and tuple(tensor.shape) == tuple(there.shape):
                state[key] = dtensor.distribute_tensor(
                    tensor.to(there.device), there.device_mesh, there.placements, src_data_rank=None
                )
    return given


def gathered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A node's state with every shard gathered into the whole tensor (on every rank)."""
    return {k: t.full_tensor() if isinstance(t, dtensor.DTensor) else t for k, t in state.items()}
