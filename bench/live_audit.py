"""What the live audit costs a fast training loop.

A hand-written step of a 3-layer MLP (64-128-128-10, batch 64, one thread: zero_grad, forward,
loss, backward, step, `.item()`), then the same step handing one `loss` fact and three `health`
facts to a watcher: a watcher that does nothing, and a `LiveAudit`. Measured interleaved in one
run, each round in a shuffled order; a block's time over the no-op block's of the same round,
median over rounds. Target: the LiveAudit step at most 1.05 x the do-nothing watcher's
(the numbers in the facts are the Audit's cost, not the figure's).

The figure's messages only cost what they cost inside a kernel (serialised, sent on iopub), so
by default this script starts a real kernel with jupyter_client and runs itself there:

    python bench/live_audit.py           # prints a markdown table
    python bench/live_audit.py --here    # in this process (no kernel: sends cost nothing)
    python bench/live_audit.py --against /tmp/base   # also another checkout's LiveAudit, A/B
    python bench/live_audit.py --rounds 21           # more rounds (11 by default)

(`git worktree add /tmp/base HEAD~3` makes such a checkout; its `somatize/figures/audit.py` is
loaded beside this one, so both are measured in the same run, interleaved.)
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def measure(loops: int = 1500, repeats: int = 11, against: str | None = None) -> dict[str, Any]:
    import torch
    from torch import nn

    from somatize.figures import LiveAudit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    a, b, c = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 10)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters(), *c.parameters()], lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    loss = nn.functional.cross_entropy
    numbers = {"grad_norm": 0.02, "update_ratio": 1e-3, "zero": 0.4, "mean": 0.1, "std": 0.9}
    places = ("mlp.0", "mlp.1", "mlp.2")
    step = [0]

    def hand() -> float:
        opt.zero_grad()
        value = loss(c(torch.relu(b(torch.relu(a(x))))), y)
        value.backward()
        opt.step()
        return value.item()

    def with_watcher(watch: Any) -> Any:
        flush = getattr(watch, "flush", None)

        def run() -> None:
            v = hand()
            s = step[0]
            step[0] += 1
            watch({"fact": "loss", "value": v, "step": s})
            for where in places:
                watch({"fact": "health", "where": where, "step": s, "numbers": dict(numbers)})
            if flush is not None:
                flush()

        run.audit = watch if hasattr(watch, "_thread") else None  # type: ignore[attr-defined]
        return run

    audit = LiveAudit(verdict=None)
    judged = LiveAudit()  # with somatize.health.verdict on every health fact
    fns: dict[str, Any] = {
        "hand step": hand,
        "+ facts to a no-op watcher": with_watcher(lambda fact: None),
        "+ facts to LiveAudit": with_watcher(audit),
        "+ facts to LiveAudit with verdicts": with_watcher(judged),
    }
    if against:
        other = _audit_class(against)
        fns["+ facts to LiveAudit (against)"] = with_watcher(other(verdict=None))
        fns["+ facts to LiveAudit with verdicts (against)"] = with_watcher(other())
    for fn in fns.values():  # warm up
        for _ in range(50):
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        # a block's place in the round shifts its time by a few % (measured: the same no-op
        # block 4 % apart first and last), so each round runs them in a new order
        shuffle(order)
        for name in order:
            fn = fns[name]
            t0, c0 = time.perf_counter_ns(), time.process_time_ns()
            for _ in range(loops):
                fn()
            wall[name].append((time.perf_counter_ns() - t0) / loops / 1e3)
            # the sender thread's work for these facts is theirs: CPU is read once it is idle
            # (every block waits about as long, so the kernel's own threads weigh the same)
            _settle(fns[name])
            cpu[name].append((time.process_time_ns() - c0) / loops / 1e3)
    audit.sync()
    judged.sync()
    noop = "+ facts to a no-op watcher"
    return {
        "us": {k: statistics.median(v) for k, v in wall.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        # each block against the no-op block of its own round (the machine's load drifts
        # between rounds more than between blocks of one round), median over rounds
        "x_wall": {k: _paired(v, wall[noop]) for k, v in wall.items()},
        "x_cpu": {k: _paired(v, cpu[noop]) for k, v in cpu.items()},
        # fastest block over fastest no-op block: other processes only ever add time
        "x_wall_min": {k: min(v) / min(wall[noop]) for k, v in wall.items()},
        "x_cpu_min": {k: min(v) / min(cpu[noop]) for k, v in cpu.items()},
        "sends": audit.sends,
        "pictures": audit.pictures,
        "steps": step[0],
        "kernel": _in_kernel(),
    }


def _paired(times: list[float], base: list[float]) -> float:
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def _audit_class(root: str) -> Any:
    """The LiveAudit of another checkout (its audit.py, loaded under another module name)."""
    import importlib.util

    path = Path(root) / "somatize" / "figures" / "audit.py"
    spec = importlib.util.spec_from_file_location("live_audit_against", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--against names a checkout; no {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveAudit


def _settle(fn: Any) -> None:
    """Wait until a LiveAudit behind `fn` has sent everything and stopped its sender; about
    the same wait for the others."""
    audit = getattr(fn, "audit", None)
    began = time.monotonic()
    while audit is not None and audit._thread is not None and time.monotonic() - began < 5:
        time.sleep(0.005)
    time.sleep(max(0.0, 0.25 - (time.monotonic() - began)))


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def table(result: dict[str, Any]) -> str:
    us, cpu, xw, xc = result["us"], result["cpu"], result["x_wall"], result["x_cpu"]
    lines = [
        f"where: {'a kernel (messages serialised and sent)' if result['kernel'] else 'no kernel'}; "
        f"{result['steps']} steps, {result['sends']} messages sent and {result['pictures']} "
        "pictures refreshed by one LiveAudit",
        "",
        "| step | wall µs | × no-op watcher | CPU µs (all threads) | × no-op watcher "
        "| fastest blocks ×, wall / CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    mw, mc = result["x_wall_min"], result["x_cpu_min"]
    for name, t in us.items():
        lines.append(
            f"| {name} | {t:.1f} | {xw[name]:.3f} | {cpu[name]:.1f} | {xc[name]:.3f} "
            f"| {mw[name]:.3f} / {mc[name]:.3f} |"
        )
    return "\n".join(lines)


def in_kernel(against: str | None = None, rounds: int = 11) -> dict[str, Any]:
    """Run `measure` in a fresh kernel and hand its answer back."""
    import json

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        here = Path(__file__).resolve()
        code = (
            f"import sys, json; sys.path.insert(0, {str(here.parent.parent)!r}); "
            f"sys.path.insert(0, {str(here.parent)!r}); import live_audit; "
            f"print('RESULT' + json.dumps(live_audit.measure(repeats={rounds}, against={against!r})))"
        )
        out: list[str] = []

        def take(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        kc.execute_interactive(code, timeout=600, output_hook=take)
        text = "".join(out)
        if "RESULT" not in text:
            raise RuntimeError(text)
        return json.loads(text.split("RESULT", 1)[1].strip().splitlines()[0])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    against = args[args.index("--against") + 1] if "--against" in args else None
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 11
    if "--here" in args:
        print(table(measure(repeats=rounds, against=against)))
    else:
        print(table(in_kernel(against, rounds)))
