"""What looking inside costs: `architecture` and `probe`, beside a plain forward of the same net.

Nets: a hand-built residual CNN with 20 convolutions (a stem, nine residual blocks of two,
a last one; 16 channels, one 3×16×16 image), as one node; and a 6-layer
`nn.TransformerEncoder` (d_model 64, 4 heads, sequence 16, batch 2), as one node.
Targets: architecture ≤ 15 ms on the CNN and ≤ 5 ms on the encoder; probe < 100 ms on the CNN.
Medians of repeats, one thread, CPU time of this process (steady on a shared machine).

    python bench/inside.py [--results]
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from _results import report
from torch import nn

from somatize import Graph, Node
from somatize.torch.inside.architecture import architecture
from somatize.torch.inside.probe import probe


class Block(nn.Module):
    """conv-bn-relu-conv-bn, plus the input, then relu."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)


class ResCNN(Node, nn.Module):
    """20 convolutions: stem, nine blocks of two, last."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(9)])
        self.last = nn.Conv2d(c, c, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.fc(torch.flatten(self.pool(self.last(self.blocks(self.stem(x)))), 1))


class Encoder(Node, nn.TransformerEncoder):
    """A 6-layer TransformerEncoder that is itself the node."""

    def __init__(self) -> None:
        nn.TransformerEncoder.__init__(
            self, nn.TransformerEncoderLayer(64, 4, 128), 6, enable_nested_tensor=False
        )

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return nn.TransformerEncoder.forward(self, x)


def median_ms(fn, repeats: int = 21, fresh=None) -> tuple[float, float]:  # noqa: ANN001
    """Median CPU and wall milliseconds; `fresh()` (untimed) makes the argument of each call."""
    fn(fresh() if fresh else None)
    cpu, wall = [], []
    for _ in range(repeats):
        arg = fresh() if fresh else None
        t0, w0 = time.process_time(), time.perf_counter()
        fn(arg)
        cpu.append((time.process_time() - t0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cnn = Graph.somatize(ResCNN())
    image = torch.randn(1, 3, 16, 16)
    enc = Graph.somatize(Encoder())
    seq = torch.randn(16, 2, 64)
    with torch.no_grad():
        cnn_fwd = median_ms(lambda _: cnn.forward(image))
        enc_fwd = median_ms(lambda _: enc.forward(seq))
    measured = [
        ("architecture, residual CNN", median_ms(lambda _: architecture(cnn, image)), cnn_fwd, 15),
        (
            "architecture, TransformerEncoder",
            median_ms(lambda _: architecture(enc, seq)),
            enc_fwd,
            5,
        ),
        (
            "architecture, TransformerEncoder, first call on a new one",
            median_ms(lambda g: architecture(g, seq), 11, lambda: Graph.somatize(Encoder())),
            enc_fwd,
            "",
        ),
        ("probe, residual CNN", median_ms(lambda _: probe(cnn, image)), cnn_fwd, 100),
    ]
    rows = [
        [name, ms, wall, fwd, ms / fwd, target] for name, (ms, wall), (fwd, _), target in measured
    ]
    how = architecture(enc, seq)["encoder"].how
    report(
        "inside",
        "architecture and probe beside a plain forward of the same net",
        ["what", "CPU ms", "wall ms", "plain forward CPU ms", "× forward", "target ms"],
        rows,
        notes=(
            "A residual CNN of 20 convolutions (one 3×16×16 image) and a 6-layer "
            "TransformerEncoder (d_model 64, sequence 16, batch 2), each one node. The "
            f"encoder is read by a {how} forward: fx cannot follow its control flow."
        ),
    )


if __name__ == "__main__":
    main()
