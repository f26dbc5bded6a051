"""Every public name has a docstring: the API reference is generated from them."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = [
    "somatize",
    "somatize.node",
    "somatize.graph",
    "somatize.run",
    "somatize.store",
    "somatize.codecs",
    "somatize.record",
    "somatize.caching",
    "somatize.torch.training.stages",
    "somatize.remote",
    "somatize.health",
    "somatize.figures",
    "somatize.torch",
]


def public(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        yield name, getattr(module, name)


def undocumented(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = [] if inspect.getdoc(module) else [module_name]
    for name, obj in public(module):
        if inspect.ismodule(obj):
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj) and obj.__module__.startswith("somatize"):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                fn = member.fget if isinstance(member, property) else member
                if (inspect.isfunction(fn) or isinstance(member, property)) and not (
                    inspect.getdoc(fn)
                ):
                    missing.append(f"{module_name}.{name}.{attr}")
    return missing


@pytest.mark.parametrize("module_name", MODULES)
def test_public_names_have_docstrings(module_name):
    assert undocumented(module_name) == []
