"""What only makes sense with torch in front of you: training, and looking inside.

The core does not know what a loss is, nor a gradient, nor an optimizer. That lives here, and
the core does not change a line for it::

    from somatize import Graph
    from somatize.torch import Trainer, parameters

    g = Graph.somatize(Encoder() >> Head())
    t = Trainer(g, objective=cross_entropy,
                optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
    t.fit(data, epochs=10)

Importing this also registers how a tensor is written down (safetensors, never pickle) and
how a value is moved to a device, which is what lets a graph keep what it produces and place
its nodes. `import torch` inside this package still brings the real torch: imports are
absolute.
"""

from __future__ import annotations

import importlib
from typing import Any

from somatize.torch import (
    _outputs,  # noqa: F401  (registers transformers' outputs' codec)
    _served,  # noqa: F401  (registers what a worker asks of torch)
)
from somatize.torch import codec as _codec  # noqa: F401  (registers the tensor codec)
from somatize.torch import placement as _placement  # noqa: F401  (registers device hooks)

_where = {
    "Trainer": "training.trainer",
    "Result": "training.trainer",
    "NoGradient": "training.trainer",
    "Learning": "training.learning",
    "Split": "training.learning",
    "Greedy": "training.greedy",
    "Synthetic": "training.synthetic",
    "ForwardForward": "training.forward_forward",
    "Enters": "training.learning",
    "Envelope": "training.learning",
    "OutOfStep": "training.learning",
    "envelope": "training.learning",
    "gradient": "training.learning",
    "fedavg": "training.federated",
    "gather": "training.federated",
    "RankLost": "training.parallel",
    "parameters": "training.params",
    "freeze": "training.params",
    "shard": "training.shard",
    "Audit": "audit.audit",
    "architecture": "inside.architecture",
    "traced": "inside.architecture",
    "kind_of": "inside.architecture",
    "Inside": "inside.architecture",
    "probe": "inside.probe",
    "proxies": "inside.proxies",
    "proxy": "inside.proxies",
    "EVERY": "inside.proxies",
}

__all__ = sorted(_where)


def __getattr__(name: str) -> Any:
    module = _where.get(name)
    if module is None:
        raise AttributeError(f"module 'somatize.torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"somatize.torch.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
