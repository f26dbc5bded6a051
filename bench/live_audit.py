"""What the live audit costs a fast training loop.

A hand-written step of a 3-layer MLP (64-128-128-10, batch 64, one thread: zero_grad,
forward, loss, backward, step, `.item()`), then the same step handing one `loss` fact and
three flat `health` facts to a watcher: a watcher that does nothing, and a `LiveAudit` (which
queues each fact, and in its sender thread keeps it in columns, judges it with the health
verdict and sends it). Measured interleaved in one run, each round in a shuffled order; a
block's time over the no-op block's of the same round, median over rounds. The sender's work
counts: CPU time is read after it has judged and sent everything. What it prints beside the
ratios is the figure's cost per fact (over the no-op watcher's, CPU), which is what a real
model pays per watched place and step (this MLP's step is so short that a few microseconds a
fact show as a ratio; a place's measuring by the Audit itself costs far more, bench/audit.py).

The figure's messages only cost what they cost inside a kernel (serialised, sent on iopub), so
by default this script starts a real kernel with jupyter_client and runs itself there:

    python bench/live_audit.py                 # in a kernel; prints the table
    python bench/live_audit.py --results       # and rewrites its section of bench/RESULTS.md
    python bench/live_audit.py --here          # in this process (no kernel: sends cost less)
    python bench/live_audit.py --rounds 21     # more rounds (11 by default)
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(loops: int = 1500, repeats: int = 11) -> dict[str, Any]:
    import torch
    from torch import nn

    from somatize.figures import LiveAudit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    a, b, c = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 10)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters(), *c.parameters()], lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    loss = nn.functional.cross_entropy
    numbers = {
        "grad_norm": 0.02,
        "update_ratio": 1e-3,
        "zero_frac_max": 0.4,
        "act_abs_mean": 0.1,
        "param_norm": 0.9,
        "nan": False,
        "inf": False,
    }
    places = ("l0", "l1", "l2")
    step = [0]

    def hand() -> float:
        opt.zero_grad()
        value = loss(c(torch.relu(b(torch.relu(a(x))))), y)
        value.backward()
        opt.step()
        return value.item()

    def with_watcher(watch: Any) -> Any:
        def run() -> None:
            v = hand()
            s = step[0]
            step[0] += 1
            watch({"fact": "loss", "value": v, "step": s})
            for node in places:
                watch({"fact": "health", "node": node, "inside": None, "step": s, **numbers})

        run.audit = watch if isinstance(watch, LiveAudit) else None  # type: ignore[attr-defined]
        return run

    audit = LiveAudit(flags=False)
    judged = LiveAudit()  # with the health verdict judging every health fact
    fns: dict[str, Any] = {
        "hand step": hand,
        "+ facts to a no-op watcher": with_watcher(lambda fact: None),
        "+ facts to LiveAudit, no verdict": with_watcher(audit),
        "+ facts to LiveAudit": with_watcher(judged),
    }
    for fn in fns.values():  # warm up
        for _ in range(50):
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)  # a block's place in the round shifts its time: a new order each round
        for name in order:
            fn = fns[name]
            t0, c0 = time.perf_counter_ns(), time.process_time_ns()
            for _ in range(loops):
                fn()
            wall[name].append((time.perf_counter_ns() - t0) / loops / 1e3)
            _settle(fn)  # the sender's work for these facts is theirs
            cpu[name].append((time.process_time_ns() - c0) / loops / 1e3)
    noop = "+ facts to a no-op watcher"
    return {
        "us": {k: statistics.median(v) for k, v in wall.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "x_wall": {k: _paired(v, wall[noop]) for k, v in wall.items()},
        "x_cpu": {k: _paired(v, cpu[noop]) for k, v in cpu.items()},
        "sends": judged.sends,
        "steps": step[0],
        "kernel": _in_kernel(),
    }


def _paired(times: list[float], base: list[float]) -> float:
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def _settle(fn: Any) -> None:
    """Wait until a LiveAudit behind `fn` has judged and sent everything; as long for the
    others (every block waits about as long, so the kernel's own threads weigh the same)."""
    audit = getattr(fn, "audit", None)
    began = time.monotonic()
    if audit is not None:
        audit.sync()
    time.sleep(max(0.0, 0.25 - (time.monotonic() - began)))


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def in_kernel(rounds: int) -> dict[str, Any]:
    """Run `measure` in a fresh kernel (local sockets) and hand its answer back."""
    import json
    import tempfile

    from jupyter_client.manager import KernelManager

    with tempfile.TemporaryDirectory() as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "k"))
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        try:
            here = Path(__file__).resolve()
            code = (
                f"import sys, json; sys.path.insert(0, {str(here.parent.parent)!r}); "
                f"sys.path.insert(0, {str(here.parent)!r}); import live_audit; "
                f"print('RESULT' + json.dumps(live_audit.measure(repeats={rounds})))"
            )
            out: list[str] = []

            def take(msg: dict) -> None:
                if msg["msg_type"] == "stream":
                    out.append(msg["content"]["text"])
                elif msg["msg_type"] == "error":
                    out.append("\n".join(msg["content"]["traceback"]))

            kc.execute_interactive(code, timeout=900, output_hook=take)
            text = "".join(out)
            if "RESULT" not in text:
                raise RuntimeError(text)
            return json.loads(text.split("RESULT", 1)[1].strip().splitlines()[0])
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


def main() -> None:
    from _results import report

    args = sys.argv[1:]
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 11
    result = measure(repeats=rounds) if "--here" in args else in_kernel(rounds)
    noop = result["cpu"]["+ facts to a no-op watcher"]
    rows = [
        [
            name,
            t,
            result["x_wall"][name],
            result["cpu"][name],
            result["x_cpu"][name],
            (result["cpu"][name] - noop) / 4 if "LiveAudit" in name else "–",
        ]
        for name, t in result["us"].items()
    ]
    where = (
        "in a kernel (messages serialised and sent)"
        if result["kernel"]
        else "in a process without a kernel"
    )
    report(
        "live_audit",
        "a fast training step handing its facts to a LiveAudit, against a watcher that does nothing",
        [
            "step",
            "wall µs",
            "× no-op watcher",
            "CPU µs, all threads",
            "CPU × no-op watcher",
            "CPU µs a fact",
        ],
        rows,
        notes=f"Measured {where}: {result['steps']} steps, {result['sends']} messages from one "
        "LiveAudit. Four facts a step (a loss, three places). Issue 16 sets the live audit no "
        "ceiling; its cost a fact is what to compare with the Audit's own per place and step.",
    )


if __name__ == "__main__":
    main()
