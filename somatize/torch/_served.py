"""What the core and a worker ask of torch through `somatize._hooks`: a node's weights and
loading them (checked whole, then copied), a tensor as a wire frame and back, what a worker may
build by name, and the requests of a trainer's stage (`stage.forward`, `stage.backward`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from somatize import _hooks, caching
from somatize.torch._modules import Held
from somatize.torch.codec import _plain
from somatize.torch.placement import modules_of
from somatize.torch.training.params import state_of as _own  # the weights as they are

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64 float32 float16 bfloat16 float8_e4m3fn float8_e5m2 complex128 complex64 "
        "int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool"
    ).split()
    if hasattr(torch, name)
}
"""The dtypes that cross a wire, by the name `str(dtype)` gives them without `torch.`."""

_MOST_DIMS = 64


def state_of(node: Any) -> dict[str, torch.Tensor]:
    """The node's weights as `{key: tensor}`, detached copies on the CPU. A Learning's are
    what it brought (a head, a guesser): the node it trains travels on its own."""
    return {k: v.detach().cpu().clone() for k, v in _own(node).items()}


def stage_state(
    node: Any, state: dict[str, Any], name: str | None = None, *, dtypes: bool = False
) -> Callable[[], Callable[[], None]]:
    """Check `state` (some or all of the node's keys) and cast copies of it to the node's
    dtypes and devices, as `load_state_dict(strict=False)` would load it; nothing is changed
    until the function given back is called, which copies them in and answers the function that
    puts back what was there. With `dtypes`, each tensor of the node takes the dtype `state`
    gives it instead (a node a worker rebuilt from its constructor arguments becomes what was
    sent: a float64 one stays float64). An unknown key, a shape that differs, a tensor without
    plain numbers (meta, sparse) or two keys of one tensor (tied weights) given different values
    is refused whole, naming the node (`name`, else its class). What a Learning builds lazily
    (`receiving`) is set on it only by that function, and taken off by the one it answers: a
    refused, dropped or undone load leaves it unbuilt."""
    from somatize.torch.training.learning import Learning

    name = name or type(node).__name__
    if not isinstance(state, dict):
        raise TypeError(f"{name}: weights are {{key: tensor}}, not {type(state).__name__}")
    parts = node.receiving(state) if isinstance(node, Learning) else {}
    own = {**_own(node), **_own(torch.nn.ModuleDict(parts))}
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(
            f"{name}: the weights hold keys {unknown}, which the node does not have; it has "
            f"{sorted(own)}; nothing was loaded{_reshaped(unknown, own)}"
        )
    staged = {}
    for key, value in state.items():
        mine = own[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name}, {key!r}: weights are tensors, not {type(value).__name__}; "
                "nothing was loaded"
            )
        if tuple(value.shape) != tuple(mine.shape):
            raise ValueError(
                f"{name}, {key!r}: the weights give shape {tuple(value.shape)}, the node has "
                f"{tuple(mine.shape)}; nothing was loaded"
            )
        if value.layout != torch.strided or value.is_meta or value.is_quantized:
            what = "on the meta device" if value.is_meta else f"{value.layout}, quantized or not"
            raise ValueError(
                f"{name}, {key!r}: a tensor {what} has no plain numbers to load (give it dense, "
                "on a real device); nothing was loaded"
            )
        try:
            dtype = value.dtype if dtypes else mine.dtype
            staged[key] = value.detach().to(device=mine.device, dtype=dtype, copy=True)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"{name}, {key!r}: {error}; nothing was loaded") from error
    tied: dict[int, str] = {}  # keys of one tensor (GPT-2's lm_head.weight is wte.weight)
    for key in staged:
        first = tied.setdefault(id(own[key]), key)
        if first != key and not torch.equal(staged[first], staged[key]):
            raise ValueError(
                f"{name}: {first!r} and {key!r} are one tensor (tied weights), and the weights "
                "give them different values: give both the same, or only one; nothing was loaded"
            )

    def commit() -> Callable[[], None]:
        held = {attribute: getattr(node, attribute) for attribute in parts}
        for attribute, part in parts.items():  # built for this load: held once it commits
            setattr(node, attribute, part)
        previous = {k: own[k].detach().clone() for k in staged}
        with torch.no_grad():
            for k, v in staged.items():
                if own[k].dtype == v.dtype:
                    own[k].copy_(v)
                else:  # the tensor itself takes the dtype (a Parameter stays the same object)
                    own[k].data = v
        caching.state_changed()  # a frozen node's new digest reaches the cache keys

        def undo() -> None:
            stage_state(node, previous, name, dtypes=True)()
            for attribute, was in held.items():  # what it held before the parts set on it
                setattr(node, attribute, was)

        return undo

    return commit


def _reshaped(unknown: list[str], own: dict[str, Any]) -> str:
    """What to do when the keys differ because one side's weight is pruned
    (`torch.nn.utils.prune`: `weight_orig` and `weight_mask`) or parametrized
    (`spectral_norm`, `weight_norm`: `parametrizations.weight.original`) and the other's is not;
    empty otherwise; or because the weights are a wrapper's (`module.` before every key)."""
    wrapped = [k for k in unknown if k.startswith("module.")]
    if wrapped and all(k.removeprefix("module.") in own for k in wrapped):
        return (
            f". The weights' keys start with 'module.' ({wrapped[0]}), as a wrapper's do "
            "(AveragedModel, DistributedDataParallel): give the state_dict of the module it "
            "wraps (ema.module.state_dict()), or the keys without 'module.'"
        )
    for key in unknown:
        head, _, leaf = key.rpartition(".")
        plain = key.removesuffix("_orig").removesuffix("_mask")
        if f"{key}_orig" in own:
            return (
                f". The node's {key} is pruned (torch.nn.utils.prune holds it as {key}_orig and "
                f"{key}_mask) and the weights' is not: load weights of a twin pruned the same "
                "way, or prune.remove(layer, name) in the node first"
            )
        if plain != key and plain in own:
            return (
                f". The weights' {plain} is pruned ({key}) and the node's is not: prune the "
                "node's layer too before loading (prune.identity(layer, name) takes any mask), "
                "or prune.remove(layer, name) in the twin before exporting"
            )
        if any(k.startswith(f"{head}.parametrizations.{leaf}.".lstrip(".")) for k in own):
            return (
                f". The node's {key} is parametrized (torch.nn.utils.parametrize: spectral_norm, "
                "weight_norm) and the weights' is not: load weights of a twin parametrized the "
                "same way"
            )
        where, _, rest = f".{key}".partition(".parametrizations.")
        if rest and f"{where}.{rest.partition('.')[0]}".lstrip(".") in own:
            return (
                f". The weights' {key} is of a parametrized layer (spectral_norm, weight_norm) "
                "and the node's is not: parametrize the node's layer the same way before "
                "loading, or parametrize.remove_parametrizations(layer, name) in the twin "
                "before exporting"
            )
    return ""


def modes(node: Any) -> Callable[[], list[bool]] | None:
    """A function that reads each module's train/eval mode in the node (`.training`, in
    `modules()` order, over the modules it holds now), or None for a node holding no module,
    or a Learning (it keeps its own)."""
    from somatize.torch.training.learning import Learning

    found = None if isinstance(node, Learning) else Held(modules_of(node)).modules
    return (lambda: [m.training for m in found]) if found else None


def set_modes(node: Any, modes: Any) -> None:
    """Put the node's modules in the modes `modes(node)` read from its copy elsewhere (each
    module's own flag, as `module.train(mode)` leaves it). Modes that do not match the
    modules held here are refused, naming the node's class."""
    found = Held(modules_of(node)).modules
    if type(modes) is not list or len(modes) != len(found) or {*map(type, modes)} - {bool}:
        raise ValueError(
            f"a {type(node).__name__} here holds {len(found)} module(s), and its copy's modes "
            f"are {modes!r:.80}: its modules differ from the copy's (build them all in its "
            "__init__, from its constructor arguments)"
        )
    for module, training in zip(found, modes, strict=True):
        if module.training is not training:  # nn.Module.__setattr__ is slow: only if moved
            module.training = training


def tensor_frame(value: Any) -> tuple[list, Any] | None:
    """`([dtype, shape, requires_grad], buffer)` for a tensor, else None: its numbers in C
    order, on the CPU, as a flat byte view of its own memory when it is already so (otherwise
    of a packed copy). Sparse, quantized and meta tensors are refused."""
    if not isinstance(value, torch.Tensor):
        return None
    plain = _plain(value, "cross the wire", "send")
    name = str(value.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"a {value.dtype} tensor cannot cross the wire")
    buffer = plain.view(-1).view(torch.uint8).numpy()
    return [name, list(plain.shape), bool(value.requires_grad)], buffer


def frame_tensor(head: list, buffer: Any) -> torch.Tensor:
    """The tensor `tensor_frame` described, built on `buffer` (copied only when the buffer is
    read-only). A head that is not `[dtype, shape, requires_grad]` or does not add up to the
    buffer's length is refused with a `ValueError` naming what is wrong."""
    if type(head) is not list or len(head) != 3:
        raise ValueError(f"a tensor's head is [dtype, shape, requires_grad], not {head!r:.80}")
    name, shape, grad = head
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise ValueError(f"a tensor of dtype {name!r:.40}, which does not cross the wire")
    if (
        type(shape) is not list
        or len(shape) > _MOST_DIMS
        or any(type(s) is not int or s < 0 for s in shape)
    ):
        raise ValueError(f"a tensor's shape is a list of sizes >= 0, not {shape!r:.80}")
    if type(grad) is not bool or (grad and not (dtype.is_floating_point or dtype.is_complex)):
        raise ValueError(f"a {name} tensor cannot ask for a gradient ({grad!r:.20})")
    view = memoryview(buffer)
    size = view.nbytes
    want = math.prod(shape) * dtype.itemsize
    if want != size:
        raise ValueError(f"a {name} tensor of shape {shape} holds {want} bytes, not {size}")
    if size == 0:
        made = torch.empty(shape, dtype=dtype)
    else:
        if view.readonly:
            view = memoryview(bytearray(view))
        made = torch.frombuffer(view, dtype=dtype).reshape(shape)
    return made.requires_grad_(True) if grad else made


def constructible(modules: list[Any]) -> list[Any]:
    """torch's optimizers (`torch.optim.SGD`, ...) and the functions of
    `torch.nn.functional` (a Learning's objective: they compute, and touch nothing else), the
    Learning classes somatize ships, and the optimizer classes defined in `modules` (the ones
    a worker was told to import)."""
    import types

    import somatize.torch as ours
    from somatize.torch.training.learning import Learning

    optimizer = torch.optim.Optimizer
    found = [v for v in vars(torch.optim).values() if _subclass(v, optimizer)]
    functional = torch.nn.functional
    found += [
        v
        for k, v in vars(functional).items()
        if not k.startswith("_")
        and isinstance(v, types.FunctionType)
        and v.__module__ == functional.__name__
    ]
    shipped = [getattr(ours, name) for name in ours.__all__]
    found += [v for v in shipped if _subclass(v, Learning) and v.__module__.startswith("somatize.")]
    for module in modules:
        found += [
            v
            for v in vars(module).values()
            if _subclass(v, optimizer) and v.__module__ == module.__name__
        ]
    return found


def _subclass(value: Any, base: type) -> bool:
    return isinstance(value, type) and issubclass(value, base)


def serve(server: Any, session: Any, op: str, message: dict) -> Any:
    """A trainer's stage on this worker (`somatize.torch.training.remote`)."""
    from somatize.torch.training.remote import serve_stage

    return serve_stage(server, session, op, message)


_hooks.register(
    state_of=state_of,
    stage_state=stage_state,
    modes=modes,
    set_modes=set_modes,
    serve=serve,
    tensor_frame=tensor_frame,
    frame_tensor=frame_tensor,
    constructible=constructible,
    no_grad=torch.no_grad,
)
