"""The examples in docs/*.md and the README, as a reader pastes them into a notebook: every
```python block of a page, in order, in one namespace per page (a page that says it goes on
from the README's first example starts from it), and what the prose says they give, they give.
A block for another machine runs against a real worker on 127.0.0.1; the torchrun script of
docs/parallel.md is launched as the page says, two ranks on gloo."""

from __future__ import annotations

import ast
import copy
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def blocks(page: Path) -> list[str]:
    """The page's python examples, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def run(code: str, scope: dict, name: str = "<doc>") -> dict[str, object]:
    """Run `code` in `scope` statement by statement, as a notebook cell; answer what each
    expression statement gave (what a notebook shows), keyed by its source's first line."""
    shown = {}
    for statement in ast.parse(code).body:
        if isinstance(statement, ast.Expr):
            value = eval(compile(ast.Expression(statement.value), name, "eval"), scope)
            shown[ast.get_source_segment(code, statement).splitlines()[0]] = value
        else:
            exec(compile(ast.Module([statement], []), name, "exec"), scope)
    return shown


def page(name: str, after_readme: bool = True) -> tuple[list[str], dict]:
    """A page's blocks and a namespace holding what the README's first example made."""
    scope: dict = {}
    if after_readme:
        torch.manual_seed(0)
        run(blocks(README)[0], scope, "README.md")
    return blocks(ROOT / "docs" / name), scope


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write runs/, ckpt.pt, weights.pt where they run


def test_the_readme_runs_in_order(capsys):
    scope: dict = {}
    torch.manual_seed(0)
    code = blocks(README)
    assert len(code) == 3 and len(code[0].strip().splitlines()) <= 20
    run(code[0], scope)
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    again = scope["t"].fit(scope["data"], epochs=1).history
    # three classes start near ln 3 = 1.0986; after six epochs on the same ten batches the
    # network has learnt something of them
    assert printed < 1.0986 and sum(again) / len(again) < 1.0986
    shown = run(code[1], scope)
    (table,) = (v for k, v in shown.items() if k.startswith("CompareTable("))
    assert table.table["index"] == ["fresh", "trained"]
    # your own model, as it is: drawn and probed whole
    assert "Graph.somatize(bert)" in code[2]
    run(code[2], scope)
    g, bert, tokens = scope["g"], scope["bert"], scope["tokens"]
    unique = sum(p.numel() for p in {id(p): p for p in bert.parameters()}.values())
    figure = g.figure(inside=scope["architecture"](g, tokens))
    assert figure.inside["bertmodel"]["params"] == unique
    found = scope["probe"](g, tokens)
    assert "bertmodel" in found and any(w.startswith("bertmodel.encoder.layer.1.") for w in found)
    assert all(isinstance(n["signal_gain"], float) for n in found.values() if "signal_gain" in n)


def test_engine():
    (code,), scope = page("engine.md", after_readme=False)
    run(code, scope)
    assert scope["y"].shape == (2, 4)


def test_training_every_block_in_order():
    code, scope = page("training.md")
    assert len(code) == 8
    shown = run(code[0], scope)
    result = scope["result"]
    said = re.search(r"# (Result\(\d+ steps, loss )", code[0]).group(1)  # what the page shows
    assert repr(result).startswith(said) and len(result.history) == 100
    assert shown["result.loss, result.history"] == (result.history[-1], result.history)
    run(code[1], scope)
    run(code[2], scope)
    # the warm-up steps once per update (20 fits of the 10 batches), on the post hook
    assert scope["warmup"].last_epoch == scope["t"].steps == 200
    run(code[3], scope)
    run(code[4], scope)
    saved = scope["t"].steps
    # resumed from the checkpoint, the run goes on loss for loss: the second load comes after
    # the Trainer has moved on, the first right after saving, as if it had never stopped
    on = run(code[5], scope)["t.fit(data)"].history
    again = run(code[5], scope)["t.fit(data)"].history
    assert scope["t"].steps == saved + len(scope["data"]) and again == on
    run(code[6], scope)
    first, second = (c.export() for c in scope["clients"])
    for node, weights in scope["avg"].items():
        for key, w in weights.items():
            mean = (288 * first[node][key].double() + 32 * second[node][key].double()) / 320
            assert w.dtype == first[node][key].dtype
            eps = torch.finfo(w.dtype).eps  # averaged in float64, cast back once
            torch.testing.assert_close(w.double(), mean, rtol=eps, atol=0)
            torch.testing.assert_close(scope["t"].export()[node][key], w, rtol=0, atol=0)
    # three clients, each its own process in the page (here a thread), meeting in runs/
    graphs = [copy.deepcopy(scope["g"]) for _ in range(3)]
    clients = []
    for k, h in enumerate(graphs):
        client = {**scope, "r": 0, "k": k}
        client["t"] = scope["Trainer"](
            h,
            objective=scope["cross_entropy"],
            optimizer=torch.optim.SGD(scope["parameters"](h), lr=0.1),
        )
        client["t"].fit(scope["data"][k : k + 1])
        clients.append(client)
    before = [c["t"].export() for c in clients]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda c: run(code[7], c), clients))
    expected = scope["fedavg"](before)  # each client saw as many samples
    for c in clients:
        for node, weights in expected.items():
            for key, w in weights.items():
                assert torch.equal(c["t"].export()[node][key], w)


def test_parallel_is_refused_in_a_notebook_and_trains_under_torchrun(tmp_path):
    code, scope = page("parallel.md")
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node=2"):
        run(code[0], scope)
    dataset = "dataset = [(x, y) for xs, ys in data for x, y in zip(xs, ys, strict=True)]"
    # the script: the README's nodes and data, the group opened with a timeout of its own
    (tmp_path / "train.py").write_text("\n".join([blocks(README)[0], code[1], dataset, code[0]]))
    ranks = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["train.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # torchrun and its ranks, stopped together if they hang
    )
    try:
        said, _ = ranks.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(ranks.pid, signal.SIGKILL)
        said, _ = ranks.communicate()
    assert ranks.returncode == 0, said[-4000:]
    weights = torch.load(tmp_path / "weights.pt")  # rank 0's
    assert set(weights) == {"encoder", "head"}, weights.keys()


MYMODELS = """
from torch import nn
from somatize import Node


class Encoder(Node, nn.Module):
    def __init__(self): nn.Module.__init__(self); self.lin = nn.Linear(8, 16)
    def forward(self, x, ctx): return self.lin(x).relu()


class Body(Node, nn.Module):
    def __init__(self): nn.Module.__init__(self); self.lin = nn.Linear(16, 16)
    def forward(self, x, ctx): return self.lin(x).relu()


class Head(Node, nn.Module):
    def __init__(self): nn.Module.__init__(self); self.lin = nn.Linear(16, 3)
    def forward(self, x, ctx): return self.lin(x)
"""


def test_remote_against_a_worker_standing_on_127_0_0_1(tmp_path, monkeypatch):
    from somatize import Worker

    (tmp_path / "mymodels.py").write_text(MYMODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = Worker.spawn(["--threads", "1"], send=["mymodels"])  # python -m somatize.worker
    monkeypatch.setenv("SOMATIZE_TOKEN", worker.token)
    try:
        (code,), scope = page("remote.md", after_readme=False)
        torch.manual_seed(0)
        scope["x"] = torch.randn(4, 8)
        scope["batches"] = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(3)]
        # node3:7000 is the reader's own machine; here the worker's address
        run(code.replace('"node3:7000"', repr(worker.address)), scope)
        assert scope["y"].shape == (4, 3) and len(scope["t"].result.history) == 9
        import mymodels

        torch.manual_seed(0)
        mymodels.Encoder()
        start = mymodels.Body().state_dict()  # the body as it was sent
        learnt = scope["weights"]["body"]
        assert set(learnt) == set(start) and not torch.equal(
            learnt["lin.weight"], start["lin.weight"]
        )
        scope["b"].close()
    finally:
        worker.stop()


def test_the_worker_help_says_the_smallest_message_the_worker_works_out():
    from somatize.remote.listener import smallest_message
    from somatize.worker import parser

    said = " ".join(parser().format_help().split())
    assert f"at least {smallest_message(False)}, {smallest_message(True)} with CURVE" in said
    text = " ".join((ROOT / "docs" / "remote.md").read_text().split())
    assert f"at least {smallest_message(False)}, or {smallest_message(True)} with CURVE" in text


def test_audit():
    code, scope = page("audit.md")
    run(code[0], scope)
    assert isinstance(scope["diagnose"](scope["store"], run="r1"), dict)
    assert run(code[1], scope)  # a health fact, as a dict


def test_figures():
    code, scope = page("figures.md")
    for block in code:
        run(block, scope)
    assert set(scope["df"].index) == {"wide", "deep"}


def test_inside():
    (code,), scope = page("inside.md", after_readme=False)
    shown = run(code, scope)
    assert scope["g"].nodes() == ["bertmodel"]
    assert shown["g.forward(batch)"].last_hidden_state.shape == (2, 16, 64)


def test_store():
    code, scope = page("store.md")  # its last block trains the README's g on its data
    shown = run(code[0], scope)
    assert scope["key"].startswith("sha256:2770")
    assert shown["store.get(key)"] == b"bytes"
    assert shown['store.claim("fed/round/0/averager", key)'] is True
    assert shown['store.recall("config")'] == {"lr": 1e-3, "sizes": (64, 32)}
    assert set(shown["store.clean()"]) == {"files", "bytes"}
    run(code[1], scope)
    runs = run(code[2], scope)["somatize.record.runs(store)"]
    assert list(runs["run"]) == ["tuesday"]
