"""Looking inside real models: `architecture` against torchview's `draw_graph`, and `probe`
against a forward, on the models of `tests/models` (transformers' BERT, GPT-2, T5, ViT,
ResNet, ConvNext, MobileNetV2; torch's Transformer, LSTM, GRU; a torchvision-style CNN), at
the small configs the tests build, and on a ResNet-18 at 224×224. Then the probe's memory on
ViT-B (at random init from its config), against a forward's.

Times are medians of the CPU time of this process, one thread (steady on a shared machine),
the four calls on a model timed in turns; each ratio is the median of the rounds' ratios.
torchview builds its graph and its graphviz description, nothing is rendered. Memory is the
peak resident set above the one before the call, sampled every millisecond while it runs, in
a fresh process per measurement (so neither call finds memory the other left behind); the
forward is a plain `model(x)` with autograd on, as a user calls it.

Targets: architecture ≤ torchview on each model; probe ≤ 5× a forward on the CNNs; probe's
peak memory ≤ 2× a forward's on ViT-B.

    python bench/models.py [--results]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from _results import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))

import zoo  # noqa: E402

from somatize.torch import architecture, probe  # noqa: E402

CNNS = {"resnet", "convnext", "mobilenet", "smallnet", "resnet-18 @224"}


def in_turns(fns: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """CPU milliseconds a call of each of `fns`, one number a round, timed in turns: each
    round times `calls` calls of each in a row, so a load that comes and goes hits all of
    them alike. One call of each first, not counted."""
    for fn in fns.values():
        fn()
    seen: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            seen[name].append((time.process_time() - t0) * 1e3 / calls)
    return seen


def ratio(over: list[float], under: list[float]) -> float:
    """The median of the rounds' ratios: each round's two timings were taken a moment apart,
    so a slow spell of the machine cancels out of each ratio."""
    return statistics.median(a / b for a, b in zip(over, under, strict=True))


def _call(model, example):  # noqa: ANN001, ANN202
    if isinstance(example, dict):
        return lambda: model(**example)
    return lambda: model(example)


def resnet18() -> zoo.Case:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        num_labels=1000,
    )
    model = ResNetForImageClassification(config)
    return zoo.Case("resnet-18 @224", model, torch.randn(2, 3, 224, 224), None, None)


def row(case: zoo.Case, rounds: int, calls: int) -> list:
    from torchview import draw_graph

    model, x = case.model, case.example
    if case.name in ("gpt2", "t5"):
        x = {**x, "use_cache": False}  # torchview cannot follow a cache object
    ms = in_turns(
        {
            "forward": _call(model, x),
            "architecture": lambda: architecture(model, x),
            "torchview": lambda: draw_graph(model, input_data=x, depth=99, save_graph=False),
            "probe": lambda: probe(model, x),
        },
        rounds,
        calls,
    )
    forward, ours, theirs, looked = (
        statistics.median(ms[k]) for k in ("forward", "architecture", "torchview", "probe")
    )
    params = sum(p.numel() for p in model.parameters())
    return [
        case.name,
        params,
        forward,
        ours,
        theirs,
        ratio(ms["architecture"], ms["torchview"]),
        looked,
        ratio(ms["probe"], ms["forward"]),
    ]


# -- memory, one process per measurement -------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(what: str) -> dict:
    """In this process: ViT-B built, then one `what` ("forward" or "probe") measured."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(num_labels=1000))
    x = torch.randn(2, 3, 224, 224)
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    before = _rss()
    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.process_time()
    if what == "forward":
        model(x)
    else:
        probe(model, x)
    took = time.process_time() - t0
    done.set()
    watcher.join()
    params = sum(p.numel() for p in model.parameters())
    return {"peak_mb": (max(peak[0], _rss()) - before) / 1e6, "cpu_s": took, "params": params}


def memory() -> list:
    got = {}
    for what in ("forward", "probe"):
        out = subprocess.run(
            [sys.executable, __file__, "--memory", what],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        got[what] = json.loads(out.stdout.strip().splitlines()[-1])
    f, p = got["forward"], got["probe"]
    return [
        f["params"],
        f["peak_mb"],
        p["peak_mb"],
        p["peak_mb"] / f["peak_mb"],
        f["cpu_s"],
        p["cpu_s"],
    ]


def main() -> None:
    if "--memory" in sys.argv:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        print(json.dumps(measure_memory(sys.argv[sys.argv.index("--memory") + 1])))
        return
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = [row(make(), 15, 3) for make in zoo.CASES.values()]
    rows.append(row(resnet18(), 5, 1))
    report(
        "models",
        "architecture against torchview, probe against a forward, on real models",
        [
            "model",
            "params",
            "forward ms",
            "architecture ms",
            "torchview ms",
            "architecture / torchview",
            "probe ms",
            "probe / forward",
        ],
        rows,
        notes=(
            "Targets: architecture ≤ torchview on every model; probe ≤ 5× a forward on the "
            f"CNNs ({', '.join(sorted(CNNS))}). CPU ms, one thread, medians of calls timed "
            "in turns; a ratio is the median of the rounds' ratios. A probe is a forward "
            "and a backward and a fixed cost: a hook pair on every box it draws, put on and "
            "taken off each call, a few reductions per box (every box it draws is measured as "
            "it runs, the first and last `most` kept), and the net set aside and put back. "
            "The small configs' forwards take a millisecond or two, where that fixed "
            "cost shows most; ResNet-18 at 224 is the size the cost was first seen at."
        ),
    )
    report(
        "models-memory",
        "probe's peak memory against a forward's, ViT-B at 224×224, batch 2",
        ["params", "forward MB", "probe MB", "probe / forward", "forward CPU s", "probe CPU s"],
        [memory()],
        notes=(
            "Peak resident memory above the one before the call, sampled every millisecond, "
            "a fresh process for each; the forward runs with autograd on. Target: ≤ 2×."
        ),
    )


if __name__ == "__main__":
    main()
