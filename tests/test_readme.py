"""The example in the README runs as written, and trains."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_example_runs_and_its_loss_falls(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    code = blocks[0]
    assert len(code.strip().splitlines()) <= 20
    import torch

    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    again = scope["t"].fit(scope["data"], epochs=1).history
    # Three classes start near ln 3 = 1.0986; after six epochs on the same ten batches the
    # network has learnt something of them.
    assert printed < 1.0986 and sum(again) / len(again) < 1.0986
