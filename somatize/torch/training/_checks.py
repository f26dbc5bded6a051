"""What a Trainer refuses before anything changes, each with an error that says what to do:
every function here only reads, and the Trainer changes things only when all have passed."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from somatize.graph import Graph
from somatize.node import Wrapped, unwrap
from somatize.run import warn, watchers
from somatize.torch._modules import join
from somatize.torch.placement import named_modules_of, trainable
from somatize.torch.training.learning import Learning
from somatize.torch.training.params import holds, owners, parameters, state_of


class Unusable(TypeError, ValueError):
    """A `watching=` or `auditing=` that cannot be used: a `TypeError` (it is the wrong kind of
    thing) that can also be caught as the `ValueError` the published package raised."""


def watchers_of(watching: Any) -> list:
    """`watching=` as a list of callables."""
    try:
        return watchers(watching)
    except TypeError as error:
        raise Unusable(str(error)) from None


def _described(value: Any) -> str:
    """A value named for a message in a line: its type and what shapes it, not its repr."""
    name = type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        keys = [str(k) for k in list(value)[:8]]
        return f"a {name} of {', '.join(keys) or 'nothing'}" + (", …" if len(value) > 8 else "")
    if isinstance(value, (tuple, list)):
        return f"a {name} of {len(value)}"
    return f"{name} {value!r:.60}"


def pair_of(batch: Any) -> tuple[Any, Any]:
    """The (input, target) a step is handed (a tuple, a namedtuple or a list of two, an
    `Opaque` around it or in either taken off); refused, naming it, when it is anything else
    or grad mode is off (inference mode too, which `torch.enable_grad()` does not undo)."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "a step needs gradients, and grad mode is off here (inside torch.no_grad() or "
            "torch.inference_mode(), or after torch.set_grad_enabled(False), as a "
            "validation cell may leave it): step outside it, or torch.set_grad_enabled(True)"
        )
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "a step needs gradients, and this runs inside torch.inference_mode(), where no "
            "tensor records any even with grad mode turned back on: step outside it"
        )
    batch = unwrap(batch)  # an Opaque around it, and in its items
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            f"a batch is (input, target), not {_described(batch)}: yield pairs from your "
            "data (for a model that computes its own loss from labels in its input: "
            "(batch, None), with objective=lambda out, _: out.loss)"
        )
    return batch[0], batch[1]


def one_loss(loss: Any) -> torch.Tensor:
    """The objective's answer, refused unless it is one number that asks for a gradient."""
    if not isinstance(loss, torch.Tensor) or loss.ndim:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(
            f"the objective gave {shape}, not a tensor with one number: reduce it "
            "(e.g. reduction='mean') so there is one loss to go backward from"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on anything being trained (it asks for no gradient): "
            "check that the objective uses the graph's output, and that not every node "
            "before it is frozen"
        )
    return loss


def something_to_train(graph: Graph) -> None:
    """Refuses a graph none of whose nodes holds a parameter that could be trained."""
    if parameters(graph):
        return
    raise ValueError(
        f"no node of this graph ({', '.join(graph.nodes())}) holds a parameter that asks for a "
        "gradient (frozen nodes hold none): there is nothing to train. Give a node an "
        "nn.Module with parameters, or leave the graph to Graph.forward"
    )


def materialised(graph: Graph, optimizer: Any) -> None:
    """Refuses weights on the meta device (shapes without values, as a model built under
    `torch.device("meta")` holds them): a node's, or an optimizer's built before they were
    given values (`to_empty` gives a module new parameters; that optimizer holds the old).
    A node `.at(host)` computes with its worker's copy, not with this one."""
    for nid in graph.nodes():
        if graph.setting(nid).host:
            continue
        meta = [
            join(name, key)
            for name, module in named_modules_of(graph.implementation(nid))
            for key, t in itertools.chain(module.named_parameters(), module.named_buffers())
            if t.is_meta
        ]
        if meta:
            raise ValueError(
                f"node {nid!r} holds {_listed(meta)} on the meta device (shapes without values), "
                "and a Trainer computes with them: give them values first, "
                "module.to_empty(device='cpu') then initialise them (reset_parameters()) or "
                "load_state_dict(...), or load_state_dict(..., assign=True), and set by hand "
                "the buffers a state_dict leaves out (persistent=False: BERT's position_ids); "
                "then build the optimizer over parameters(g)"
            )
    if hasattr(optimizer, "param_groups") and any(p.is_meta for p in holds(optimizer)):
        raise ValueError(
            "the optimizer holds parameters on the meta device, which no node of this graph "
            "holds now: it was built before the weights were given values (to_empty makes new "
            "parameters). Build it again over parameters(g)"
        )


def count(value: Any, name: str, meaning: str) -> int:
    """`every` or `micro`: a positive int; `meaning` says what it counts."""
    if type(value) is not int or value < 1:
        raise ValueError(f"Trainer({name}={value!r}): {name} is a positive int ({meaning})")
    return value


def resumable(steps: Any, open_group: bool) -> None:
    """`t.steps = n`: an int >= 0, set while no group is open."""
    if type(steps) is not int or steps < 0:
        raise ValueError(f"t.steps is how many steps the run has taken, an int >= 0, not {steps!r}")
    if open_group:
        raise RuntimeError(
            "t.steps is set between updates, and a group of accumulated steps is open here: "
            "call t.update() first (a checkpoint is saved between updates too)"
        )


def batch_first(graph: Graph, micro: int) -> None:
    """Refuses `micro` > 1 on a graph holding a time-first layer or a trained BatchNorm. A bare
    nn.MultiheadAttention is not looked at: the models that hold one time first (DETR, CLIP)
    turn a batch-first input around before it, and cutting that input is right."""
    if micro == 1:
        return
    for nid in graph.nodes():
        frozen = graph.setting(nid).frozen
        for name, held in named_modules_of(graph.implementation(nid)):
            for inner, m in held.named_modules():
                where = join(name, inner)
                at = f"holds at {where!r}" if where else "is"
                if isinstance(m, _BATCH) and not (frozen and m.track_running_stats):
                    raise ValueError(
                        f"micro={micro} cuts a batch into pieces, and node {nid!r} {at} an "
                        f"nn.{type(m).__name__}, which normalises each piece by the statistics "
                        "of that piece: the update would not be that of the whole batch. Use "
                        "micro=1, or declare the node .frozen() if it is not trained (it then "
                        "runs in eval mode, on its running statistics)"
                    )
                if isinstance(m, _TIME) and not getattr(m, "self_attn", m).batch_first:
                    raise ValueError(
                        f"micro={micro} cuts a batch along its first dimension, and node "
                        f"{nid!r} {at} an nn.{type(m).__name__} built with batch_first=False, "
                        "which takes (time, batch, ...): its pieces would be stretches of time. "
                        "Build it with batch_first=True and put the batch first, or use micro=1"
                    )


def ragged(data: Any, micro: int) -> None:
    """Refuses, before the first step, a DataLoader (a `batch_size`, a `sampler` with a length)
    with a batch, the last one included, that `micro` does not divide."""
    size = getattr(data, "batch_size", None)
    if micro == 1 or type(size) is not int:
        return
    try:
        n = len(data.sampler)
    except (AttributeError, TypeError):
        return
    last = 0 if getattr(data, "drop_last", True) else n % size
    if size % micro or last % micro:
        raise ValueError(
            f"micro={micro} cuts each batch into {micro} equal pieces, and this "
            f"{type(data).__name__} gives batches of {size} examples"
            f"{f' and a last one of {last} ({n} in all)' if last % micro else ''}: "
            f"pass drop_last=True, a batch_size that {micro} divides, or micro=1"
        )


_TIME = (nn.RNNBase, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_BATCH = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_BATCH += (nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


def trains_of(graph: Graph, trains: Any) -> dict[str, Learning]:
    """`trains=` checked: ids of this graph, each its own Learning, none frozen."""
    if trains is None:
        return {}
    if not isinstance(trains, dict):
        raise TypeError(f"trains= is a dict {{node id: Learning}}, not {type(trains).__name__}")
    seen: dict[int, str] = {}
    for nid, learning in trains.items():
        if nid not in graph:
            raise ValueError(
                f"trains= names {nid!r}, and no node of this graph has that id; "
                f"it has {graph.nodes()}"
            )
        if not isinstance(learning, Learning):
            raise TypeError(
                f"trains[{nid!r}] is a {type(learning).__name__}, not a Learning: "
                "say how the node is trained, e.g. Split(torch.optim.SGD, lr=0.1)"
            )
        if graph.setting(nid).frozen:
            raise ValueError(
                f"node {nid!r} is declared .frozen() and is in trains=: a node cannot be "
                "both; take it out of trains=, or drop .frozen() (on a graph already built: "
                f"g.declare({nid!r}, frozen=False) and module.requires_grad_(True))"
            )
        if not trainable(graph.implementation(nid)):
            raise ValueError(
                f"trains= names node {nid!r}, which holds no parameter that asks for a "
                f"gradient ({type(graph.implementation(nid)).__name__}): there is nothing for "
                f"{type(learning).__name__} to train there; take it out of trains="
            )
        other = learning.node
        if other is not None and other is not graph.implementation(nid):
            raise ValueError(
                f"trains[{nid!r}] already trains another node: give each node its own Learning"
            )
        if id(learning) in seen:
            raise ValueError(
                f"trains= gives the same Learning to {seen[id(learning)]!r} and {nid!r}: "
                "a Learning trains one node; give each its own"
            )
        seen[id(learning)] = nid
    return dict(trains)


def held_by(
    graph: Graph, optimizer: Any, trains: dict[str, Learning]
) -> dict[str, list[torch.Tensor]]:
    """`{node: the parameters of it the optimizer holds that ask for a gradient}`, the
    optimizer checked against the graph and `trains`."""
    if optimizer is None:
        if not trains:
            raise ValueError(
                "nothing would train: pass optimizer= (torch.optim.Adam(parameters(g), lr=1e-3)), "
                "or trains= for the nodes trained where they run"
            )
        return {}
    if isinstance(optimizer, (list, tuple)):
        raise TypeError(
            f"optimizer= takes one torch optimizer, not a {type(optimizer).__name__} of "
            f"{len(optimizer)}: give parts of the graph their own learning rate or weight decay "
            "with param groups in one, and train a node that needs another kind of optimizer "
            "beside the rest, trains={node: Split(torch.optim.SGD, lr=...)}, which in one "
            "process trains as plain backpropagation does. Updates that take turns on "
            "objectives of their own (a GAN's discriminator, then its generator) are one "
            "Trainer each, over the graph of what each runs, stepped in turn"
        )
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"optimizer= takes a torch optimizer built over the graph's parameters "
            f"(torch.optim.Adam(parameters(g), lr=1e-3)), not {type(optimizer).__name__}"
        )
    if _needs_closure(optimizer):
        raise TypeError(
            f"{type(optimizer).__name__}.step needs a closure that runs the forward and backward "
            "again, several times per update, and a Trainer's step runs them once per batch: "
            "use an optimizer whose step takes none (SGD, Adam, AdamW, ...), or write that "
            "loop by hand over g.forward"
        )
    held = holds(optimizer)
    owner = owners(graph)
    mine = [owner[id(p)] for p in held if id(p) in owner]
    if not mine:
        raise ValueError(
            f"the optimizer holds {len(held)} parameter(s) and none of them is a parameter "
            "of this graph: build it over parameters(g)"
        )
    for nid in dict.fromkeys(mine):
        if nid in trains:
            raise ValueError(
                f"the optimizer holds parameters of node {nid!r}, which trains= also "
                f"trains: it would be updated twice. Build the optimizer over "
                "parameters(g, without=trains)"
            )
        if graph.setting(nid).frozen:
            raise ValueError(
                f"the optimizer holds parameters of node {nid!r}, which is declared "
                ".frozen(): a node cannot be both frozen and trained. Build the optimizer "
                "over parameters(g), which leaves frozen nodes out; or, to train it again, "
                f"g.declare({nid!r}, frozen=False) and turn its requires_grad back on "
                "(module.requires_grad_(True)) first"
            )
    found: dict[str, list[torch.Tensor]] = {}
    for p in held:
        if id(p) in owner and p.requires_grad:
            found.setdefault(owner[id(p)], []).append(p)
    return found


def _needs_closure(optimizer: Any) -> bool:
    """Whether an optimizer's `step` needs an argument (LBFGS's closure), read on its class,
    as a scheduler wraps the instance's."""
    try:
        said = list(inspect.signature(type(optimizer).step).parameters.values())[1:]  # self
    except (TypeError, ValueError):  # no signature to read: it is called, and says itself
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in kinds and p.default is inspect.Parameter.empty for p in said)


def _reached(fn: Any) -> dict[str, nn.Module]:
    """The modules a function reaches by name: in its closure, or globals its code names."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    found: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        with contextlib.suppress(ValueError):  # a cell not filled yet
            found[name] = cell.cell_contents
    scope = getattr(fn, "__globals__", {})
    found.update({k: scope[k] for k in code.co_names if k in scope})
    return {k: v for k, v in found.items() if isinstance(v, nn.Module)}


def closed_over(graph: Graph, optimizer: Any) -> None:
    """Warn of a function node calling a module it reaches by name (`_reached`) whose trainable
    parameters are no node's and not the optimizer's: they would never move, silently."""
    held = set(owners(graph)) | {id(p) for p in holds(optimizer)}
    for nid in graph.topological_sort():
        node = graph.implementation(nid)
        if not isinstance(node, Wrapped) or isinstance(node.held, nn.Module):
            continue
        for name, module in _reached(node.held).items():
            left = [p for p in module.parameters() if p.requires_grad and id(p) not in held]
            if left:
                warn(
                    f"node {nid!r} is a function that calls {name!r} "
                    f"({type(module).__name__}), whose {len(left)} parameter(s) ask for a "
                    "gradient; they are no node's, so parameters(g) leaves them out and "
                    "the Trainer trains none of them. Hold the module in the node "
                    "(Node.of(module), or a module of your own around it), or turn their "
                    f"gradients off ({name}.requires_grad_(False)) if it is meant to stay"
                )


def audit_of(auditing: Any) -> Any:
    """`auditing=` as an Audit, or None."""
    if auditing is None or auditing is False:
        return None
    if auditing is True:
        from somatize.torch.audit.audit import Audit

        return Audit()
    methods = ("watch", "observed", "moved", "release")
    if isinstance(auditing, type) or not all(callable(getattr(auditing, m, None)) for m in methods):
        what = type(auditing).__name__
        if isinstance(auditing, type):  # the class, whose methods are there unbound
            what = f"the class {auditing.__name__}: build one, {auditing.__name__}()"
        raise Unusable(f"auditing= takes an Audit (or True for the default one), not {what}")
    return auditing


def _not_finite(graph: Graph) -> tuple[list[str], list[str]]:
    """The qualified names of the graph's parameters, and of its buffers, holding a NaN or an
    infinity (a tied tensor by its first key)."""
    found: dict[int, tuple[bool, str]] = {}
    for nid in graph.nodes():
        for key, t in state_of(graph.implementation(nid)).items():
            if id(t) not in found and t.is_floating_point() and not torch.isfinite(t).all():
                found[id(t)] = (isinstance(t, nn.Parameter), join(nid, key))
    return [n for p, n in found.values() if p], [n for p, n in found.values() if not p]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def finite(loss: torch.Tensor, graph: Graph, step: int, piece: int | None) -> None:
    """Under `Trainer(finite=True)`: refuses a loss that is NaN or infinite, before its
    backward, saying whether the weights or this batch made it, and which buffers it spoilt."""
    value = loss.item()
    if math.isfinite(value):
        return
    where = f"step {step}" if piece is None else f"step {step} (piece {piece} of its batch)"
    params, buffers = _not_finite(graph)
    if params:
        why = (
            f"The weights were not finite already ({_listed(params)}): an update before this "
            "step put that there, from a gradient that was not finite though its loss was. To "
            "stop at such a gradient, before the optimizer moves, call torch's own check "
            "clip_grad_norm_(parameters(g), float('inf'), error_if_nonfinite=True) in a step "
            "pre-hook on the optimizer (docs/training.md)"
        )
    else:
        why = (
            "The weights are finite, as the last update left them: this batch made it. Look "
            "at the batch (a NaN or an infinity in it?), or lower the learning rate"
        )
    if buffers:
        why += (
            f". Buffers are not finite ({_listed(buffers)}): a forward updates them as it runs "
            "(a BatchNorm's running statistics take in every batch), and no optimizer does; "
            "load them from weights exported before"
        )
    raise FloatingPointError(
        f"{where}: the loss is {value}, and finite=True stops there, before its backward (the "
        f"group this step was in is dropped). {why}; the losses up to here are in "
        "Trainer.result.history"
    )
