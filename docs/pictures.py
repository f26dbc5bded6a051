"""The README's pictures and its Binder badge, made from what they stand for.

    python docs/pictures.py            # run the README's code, draw docs/pictures/*.svg, badge
    python docs/pictures.py --check    # exit 1 if the README's badge is not the setting's

The README's first two python blocks (a graph trained, then the three figures) run here as one
script; each figure it makes is written with `save_svg`: graph.svg, audit.svg, table.svg. The
badge's path is `[project.urls] Repository` in pyproject.toml, the one place it is set; the
README's badge (between `<!-- binder -->` markers) is written from it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PICTURES = ROOT / "docs" / "pictures"
NOTEBOOK = "notebooks/01_tour.ipynb"
_BADGE = re.compile(r"(<!-- binder[^>]*-->\n)(.*?)(\n<!-- /binder -->)", re.S)


def badge() -> str:
    """The Binder badge for the repository pyproject.toml names."""
    setting = re.search(r'^Repository\s*=\s*"([^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    url = setting.group(1) if setting else ""
    path = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)/?", url)
    if path is None:
        raise ValueError(
            f"[project.urls] Repository in pyproject.toml is https://github.com/OWNER/NAME, not {url!r}"
        )
    return (
        "[![Binder](https://mybinder.org/badge_logo.svg)]"
        f"(https://mybinder.org/v2/gh/{path.group(1)}/HEAD?urlpath=lab/tree/{NOTEBOOK})"
    )


def readme_badge(text: str) -> str:
    """The badge the README holds between its markers."""
    found = _BADGE.search(text)
    if found is None:
        raise ValueError("README.md has no <!-- binder --> ... <!-- /binder --> markers")
    return found.group(2)


def blocks(text: str) -> list[str]:
    """The README's python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def figures(text: str) -> dict[str, object]:
    """Run the README's first two blocks; the figures they made, by kind."""
    import torch

    from somatize.figures import CompareTable, GraphFigure, LiveAudit

    torch.manual_seed(0)
    made: list[object] = []
    scope: dict = {}
    # as in a notebook: what a line evaluates to is what it shows
    for stmt in ast.parse("\n".join(blocks(text)[:2])).body:
        if isinstance(stmt, ast.Expr):
            made.append(eval(compile(ast.Expression(stmt.value), "README.md", "eval"), scope))
        else:
            exec(compile(ast.Module([stmt], []), "README.md", "exec"), scope)
    made += [v for v in scope.values() if isinstance(v, LiveAudit)]
    kinds = {"graph": GraphFigure, "audit": LiveAudit, "table": CompareTable}
    return {k: next(f for f in made if isinstance(f, c)) for k, c in kinds.items() if any(isinstance(f, c) for f in made)}


def main(argv: list[str] | None = None) -> int:
    """Command line: write the pictures and the badge, or check the badge."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only check the README's badge")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    want = badge()
    if args.check:
        if readme_badge(text) != want:
            print(f"README.md's Binder badge is not the one pyproject.toml sets: run python docs/pictures.py\n  {want}")
            return 1
        return 0
    README.write_text(_BADGE.sub(lambda m: m.group(1) + want + m.group(3), text), encoding="utf-8")
    PICTURES.mkdir(parents=True, exist_ok=True)
    drawn = figures(text)
    for kind, figure in drawn.items():
        figure.save_svg(PICTURES / f"{kind}.svg")
    print(f"wrote {', '.join(f'docs/pictures/{k}.svg' for k in drawn)} and the README's badge")
    return 0


if __name__ == "__main__":
    sys.exit(main())
