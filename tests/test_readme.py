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


def test_your_own_model_as_the_readme_writes_it_is_drawn_and_probed_whole():
    block = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[2]
    assert "Graph.somatize(bert)" in block
    import torch

    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    g, bert, tokens = scope["g"], scope["bert"], scope["tokens"]
    unique = sum(p.numel() for p in {id(p): p for p in bert.parameters()}.values())
    figure = g.figure(inside=scope["architecture"](g, tokens))
    assert figure.inside["bertmodel"]["params"] == unique
    found = scope["probe"](g, tokens)
    assert "bertmodel" in found and any(w.startswith("bertmodel.encoder.layer.1.") for w in found)
    assert all(isinstance(n["signal_gain"], float) for n in found.values() if "signal_gain" in n)
