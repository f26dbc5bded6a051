"""Values written as code (cloudpickle) for a worker started with `--accept-code`: a node's
class and arguments, a Learning's objective. A torch module with parametrizations (a weight
norm, as wav2vec2's positional convolution has) goes as the module without them and the
parametrizations to put back, since torch refuses to pickle one as it is. A transformers
model's recording hooks (closures over this process, installed by its first forward asking
for hidden states) go as hooks that do nothing, without their mark: the worker installs its
own, after `recording`."""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import types
from typing import Any

import cloudpickle

_RECORDER = "transformers.utils.output_capturing"  # where transformers' recording hooks are made
_INSTALLED = "_output_capturing_hooks_installed"  # its mark on a model whose hooks are installed


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # no module is parametrized before torch is imported
        if torch is not None and isinstance(obj, torch.nn.Module):
            if torch.nn.utils.parametrize.is_parametrized(obj):
                return _unparametrized(obj, torch.nn.utils.parametrize)
            if _INSTALLED in vars(obj):
                plain = copy.copy(obj)  # its own attributes: the model here keeps its mark
                delattr(plain, _INSTALLED)
                return plain.__reduce_ex__(5)
        if isinstance(obj, types.FunctionType) and obj.__module__ == _RECORDER:
            if "<locals>" in obj.__qualname__:  # a recording hook: made in this process
                return _unheard, ()
        return super().reducer_override(obj)


def _unheard() -> Any:
    """A hook that does nothing, in place of a recording hook of the process that sent it."""
    return lambda *_: None


def recording(modules: Any) -> None:
    """Fills in, in this process, what each transformers model class among `modules` records
    (transformers does it when a model is built, and a model read back was not): one model of
    each class built on the meta device from the model's config, which takes no memory and is
    dropped. Without it a model read back records nothing: its `hidden_states` are None and
    SegFormer's decoder, which reads them, fails. A class not built from its config alone is
    left as it came."""
    transformers, torch = sys.modules.get("transformers"), sys.modules.get("torch")
    if transformers is None or torch is None:
        return
    done: set[type] = set()
    for module in modules:
        kind = type(module)
        if isinstance(module, transformers.PreTrainedModel) and kind not in done:
            done.add(kind)
            with contextlib.suppress(Exception), torch.device("meta"):
                kind(module.config)


def _unparametrized(module: Any, parametrize: Any) -> tuple:
    """How to build `module` again: a copy of it with each parametrized tensor left as the
    value it computes, and for each tensor its parametrizations and which of its originals
    took a gradient. The weights are not what counts: the worker loads the node's state."""
    plain, lists, cls = copy.deepcopy(module), [], type(module)
    # the copy shares its class with `module`; removing a parametrization changes the class
    own = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    plain.__class__ = type(cls.__name__, cls.__bases__, own)
    for name, chain in module.parametrizations.items():
        originals = list(plain.parametrizations[name].parameters(recurse=False))
        lists.append((name, list(chain), [p.requires_grad for p in originals]))
        for p in originals:  # so that the tensor left is a parameter, as they are, not a buffer
            p.requires_grad_(True)
        parametrize.remove_parametrizations(plain, name, leave_parametrized=True)
    return reparametrized, (plain, lists)


def reparametrized(plain: Any, lists: list) -> Any:
    """`plain` with the parametrizations `lists` names registered again, in their order (what
    a parametrized module written by this module's pickler is read back as)."""
    from torch.nn.utils import parametrize

    for name, chain, grads in lists:
        for p in chain:
            parametrize.register_parametrization(plain, name, p)
        for original, grad in zip(
            plain.parametrizations[name].parameters(recurse=False), grads, strict=True
        ):
            original.requires_grad_(grad)
    return plain


def as_code(value: Any, send: tuple[str, ...] = ()) -> bytes:
    """`value` written as code (cloudpickle), the modules named in `send` by value (their
    code travels along), parametrized torch modules as this module's docstring says."""
    added = []
    try:
        for name in send:
            module = sys.modules.get(name)
            if module is not None:
                with contextlib.suppress(ValueError):  # already registered
                    cloudpickle.register_pickle_by_value(module)
                    added.append(module)
        out = io.BytesIO()
        _Pickler(out).dump(value)
        return out.getvalue()
    finally:
        for module in added:
            cloudpickle.unregister_pickle_by_value(module)
