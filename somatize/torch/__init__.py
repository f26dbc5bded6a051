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

_PROVIDED = {
    "training.trainer": "Trainer Result NoGradient",
    "training.learning": "Learning Split Enters Envelope OutOfStep envelope gradient",
    "training.greedy": "Greedy",
    "training.synthetic": "Synthetic",
    "training.forward_forward": "ForwardForward",
    "training.federated": "fedavg gather",
    "training.parallel": "RankLost",
    "training.params": "parameters named_parameters freeze",
    "training.shard": "shard",
    "audit.audit": "Audit",
    "inside.architecture": "architecture traced kind_of Inside",
    "inside.probe": "probe",
    "inside.proxies": "proxies proxy EVERY ProxyLeftOut",
}
_where = {name: module for module, names in _PROVIDED.items() for name in names.split()}

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
