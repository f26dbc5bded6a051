"""The documentation holds: every public name has a docstring (the API reference is generated
from them, a page per module, the subpackages included), and the site builds with every link
between its pages leading somewhere."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build():
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build()
MODULES = build.module_names()


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


def test_the_reference_covers_every_subpackage():
    for package in ("somatize.torch.training", "somatize.torch.inside", "somatize.torch.audit"):
        assert package in MODULES
        folder = ROOT.joinpath(*package.split("."))
        for path in folder.glob("*.py"):
            if not path.stem.startswith("_"):
                assert f"{package}.{path.stem}" in MODULES
    assert not any(part.startswith("_") for name in MODULES for part in name.split("."))


@pytest.mark.parametrize("module_name", MODULES)
def test_public_names_have_docstrings(module_name):
    assert undocumented(module_name) == []


def test_the_site_builds_and_every_link_between_its_pages_resolves(tmp_path):
    site = build.site(tmp_path / "site")
    for name in MODULES:  # a reference page per public module
        assert (site / "api" / Path(*name.split("."))).with_suffix(".html").exists(), name
    pages = [p for p in site.rglob("*.html") if "api" not in p.relative_to(site).parts]
    assert {p.stem for p in pages} >= {"index", "engine", "internals", "results"}
    for page in pages:
        for href in re.findall(r'href="([^"#]+)', page.read_text(encoding="utf-8")):
            if "://" in href or href.startswith("mailto:"):
                continue
            assert (page.parent / href).resolve().exists(), f"{page.name} links to {href}"
