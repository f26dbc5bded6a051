"""Which weights a graph holds, and settling the ones declared `.frozen()`; a node that is
an `nn.Module` and one holding modules as attributes count the same."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch
from torch import nn

from somatize import caching
from somatize.graph import as_graph
from somatize.torch._modules import join, named_modules_of
from somatize.torch.placement import modules_of

__all__ = ["parameters", "named_parameters", "freeze", "state_of", "owners", "named", "trained"]


def parameters(graph: Any, without: Container[str] = ()) -> list[nn.Parameter]:
    """The parameters of every node in the graph that has any, for an optimizer to hold.

    In declaration order, each once even when two nodes share a module. `without` names the
    nodes somebody else updates (pass the `trains` dict itself)::

        trains = {"body": Split(SGD, lr=0.1)}
        Adam(parameters(g, without=trains), lr=1e-3)

    Left out as well, because no optimizer could move them: the nodes declared `.frozen()`,
    and parameters whose `requires_grad` is off. A node holding no module is skipped, so a
    tokenizer does not stop being a node for having nothing to train. A bare module is taken
    as the Trainer takes it, a graph of that one node.
    """
    graph = as_graph(graph)
    nodes = [nid for nid in graph.nodes() if nid not in without and not graph.setting(nid).frozen]
    return trainable_in([m for nid in nodes for m in modules_of(graph.implementation(nid))])


def trainable_in(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of these modules that ask for a gradient, each once, in order."""
    found = dict.fromkeys(p for m in modules for p in m.parameters())
    return [p for p in found if p.requires_grad]


def named_parameters(graph: Any, without: Container[str] = ()) -> list[tuple[str, nn.Parameter]]:
    """`parameters(graph, without)` as `(qualified name, parameter)` pairs, the node id before
    the key its node gives it (`enc.net.0.weight`), for param groups chosen by name::

        named = named_parameters(g)
        AdamW([{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
               {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}])
    """
    graph = as_graph(graph)
    names = named(graph)
    return [(names[id(p)], p) for p in parameters(graph, without)]


def named(graph: Any) -> dict[int, str]:
    """`{id(parameter): its qualified name}`, the node id before the key its node gives it
    (`body.pooler.dense.weight`); a parameter two nodes share goes by its first."""
    found: dict[int, str] = {}
    for nid in graph.nodes():
        for name, module in named_modules_of(graph.implementation(nid)):
            for key, p in module.named_parameters():
                found.setdefault(id(p), eager(join(nid, name, key)))
    return found


def eager(key: str) -> str:
    """A key without the `_orig_mod` torch.compile puts in it, as the module it compiled names
    it: a compiled node's weights load into its eager twin, and back."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def owners(graph: Any) -> dict[int, str]:
    """`{id(parameter): node id}`: which node each parameter of the graph belongs to (first)."""
    # a node id holds no "." (g.node and .named refuse one): it is the name's first part
    return {pid: name.partition(".")[0] for pid, name in named(graph).items()}


def holds(optimizer: Any) -> list[torch.Tensor]:
    """The parameters an optimizer holds, group by group (none for no optimizer)."""
    if optimizer is None:
        return []
    return [p for group in optimizer.param_groups for p in group["params"]]


def trained(graph: Any, optimizer: Any, trains: Container[str]) -> list[nn.Module]:
    """The modules of the nodes a run trains: those the optimizer holds a parameter of, and
    those in `trains`, each once."""
    owner = owners(graph)
    held = {owner.get(id(p)) for p in holds(optimizer)}
    nodes = [nid for nid in graph.nodes() if nid in held or nid in trains]
    return list(dict.fromkeys(m for nid in nodes for m in modules_of(graph.implementation(nid))))


def freeze(graph: Any, *node_ids: str) -> None:
    """Settles these nodes, or with no ids whatever was already declared `.frozen()`: every
    parameter they hold stops asking for a gradient and their modules go to eval mode. With ids
    it declares them frozen first. Refused before anything changes: an unknown id, and a
    parameter a node to be frozen holds that a node not frozen trains (`untied_from_frozen`)."""
    for nid in node_ids:
        if nid not in graph:
            raise ValueError(f"freeze: no node {nid!r} in this graph; it has {graph.nodes()}")
    untied_from_frozen(graph, {n for n in graph.nodes() if graph.setting(n).frozen} | set(node_ids))
    for nid in node_ids:
        if not graph.setting(nid).frozen:
            graph.declare(nid, frozen=True)
    for nid in graph.nodes():
        if graph.setting(nid).frozen:
            for module in modules_of(graph.implementation(nid)):
                module.requires_grad_(False)
                module.eval()
    caching.state_changed()


def trainable_params(graph: Any, nid: str) -> list[tuple[str, nn.Parameter]]:
    """The parameters of node `nid` that ask for a gradient, by their keys in `state_of`."""
    state = state_of(graph.implementation(nid)).items()
    return [(k, t) for k, t in state if isinstance(t, nn.Parameter) and t.requires_grad]


def untied_from_frozen(graph: Any, frozen: set[str]) -> None:
    """Refuse a parameter that a node in `frozen` holds and a node not in it trains (tied
    weights, Qwen2's embeddings in a frozen body and its output layer in a trained head):
    settling the frozen node would freeze it for the other too, which would train without it."""
    held = {id(t): (nid, k) for nid in frozen for k, t in trainable_params(graph, nid)}
    for nid in graph.topological_sort():
        if nid in frozen:
            continue
        for key, t in trainable_params(graph, nid):
            if id(t) in held:
                fid, fkey = held[id(t)]
                raise ValueError(
                    f"node {fid!r} is frozen and holds {fkey}, which node {nid!r} holds as {key} "
                    f"(tied weights): settling {fid!r} would freeze it in {nid!r} too, which "
                    f"would train without it. Freeze {nid!r} as well, or untie them: give the "
                    "frozen one a copy of its own, "
                    "module.weight = nn.Parameter(module.weight.detach().clone())"
                )


def state_of(node: Any) -> dict[str, torch.Tensor]:
    """The node's state as `{key: tensor}` (parameters and buffers, the tensors themselves): a
    module's own `state_dict` keys, or a holder's prefixed by the attribute (`net.0.weight`),
    a compiled module's as the module it compiled names them (no `_orig_mod.`)."""
    return {
        eager(join(name, key)): tensor
        for name, module in named_modules_of(node)
        for key, tensor in module.state_dict(keep_vars=True).items()
    }
