"""Data for the figure tests: a plan and insides shaped like what the core and
`somatize.torch.architecture` produce, for a small graph like the published picture's
(enc >> (left | right) >> join >> head, a residual block folded x3 inside enc)."""

from __future__ import annotations


def _node(name: str, kind: str) -> dict:
    """One node of a plan_json(), unplaced and unmarked."""
    return {
        "id": name,
        "kind": kind,
        "device": None,
        "host": None,
        "frozen": False,
        "cached": False,
        "salt": None,
        "mapped": False,
    }


def plan(**marks: dict) -> dict:
    """The plan_json() of enc >> (left | right) >> join >> head; `marks` add settings."""
    ids = ["enc", "left", "right", "join", "head"]
    kinds = {"enc": "Holds", "left": "Holds", "right": "Holds", "join": "Join", "head": "Holds"}
    nodes = [{**_node(n, kinds[n]), **marks.get(n, {})} for n in ids]
    edges = [
        ["enc", "left"],
        ["enc", "right"],
        ["left", "join"],
        ["right", "join"],
        ["join", "head"],
    ]
    return {"nodes": nodes, "edges": edges, "roots": ["enc"], "leaves": ["head"], "order": ids}


def _layer(path, kind, label, shape=None, params=0, block=None, times=1, repeats=()):
    return {
        "path": path,
        "kind": kind,
        "label": label,
        "shape": shape,
        "params": params,
        "block": block,
        "times": times,
        "repeats": list(repeats),
    }


def _r(name):
    return [f"blocks.1.{name}", f"blocks.2.{name}"]


def inside_enc() -> dict:
    """enc: Conv2d, ReLU, a residual block folded x3, a pool and a flatten (as architecture()
    answers for it: the folded block's layers carry its times and their hidden repeats)."""
    s = [4, 8, 8, 8]
    layers = [
        _layer("conv", "conv", "Conv2d 3→8 3", s, 224),
        _layer("act", "activation", "ReLU", s),
        _layer("blocks", "block", "Sequential", s, 3 * 640),
        _layer("blocks.0", "block", "Res", s, 640, "blocks", 3, ["blocks.1", "blocks.2"]),
        _layer("blocks.0.conv", "conv", "Conv2d 8→8 3", s, 584, "blocks.0", 3, _r("conv")),
        _layer("blocks.0.bn", "norm", "BatchNorm2d 8", s, 16, "blocks.0", 3, _r("bn")),
        _layer("blocks.0.add", "other", "add", s, 0, "blocks.0", 3, _r("add")),
        _layer("blocks.0.relu", "activation", "relu", s, 0, "blocks.0", 3, _r("relu")),
        _layer("pool", "shaping", "AdaptiveAvgPool2d", [4, 8, 1, 1]),
        _layer("flat", "shaping", "Flatten", [4, 8]),
    ]
    edges = [
        ["conv", "act"],
        ["act", "blocks.0.conv"],
        ["blocks.0.conv", "blocks.0.bn"],
        ["blocks.0.bn", "blocks.0.add"],
        ["act", "blocks.0.add"],
        ["blocks.0.add", "blocks.0.relu"],
        ["blocks.0.relu", "pool"],
        ["pool", "flat"],
    ]
    return {"layers": layers, "edges": edges, "how": "symbolic", "why": None}


def inside_linear(relu: bool) -> dict:
    layers = [_layer("0", "learned", "Linear 8→16", [4, 16], 144)]
    edges = []
    if relu:
        layers.append(_layer("1", "activation", "ReLU", [4, 16]))
        edges.append(["0", "1"])
    return {"layers": layers, "edges": edges, "how": "traced", "why": None}


def insides() -> dict:
    """Insides for enc, left and right."""
    return {"enc": inside_enc(), "left": inside_linear(True), "right": inside_linear(False)}


def chain_plan(n: int) -> dict:
    """A plan of about n nodes: a chain with a diamond (two branches meeting) every sixth."""
    ids, edges = [], []
    prev = None
    while len(ids) < n:
        k = len(ids)
        if k % 6 == 3 and prev is not None and len(ids) + 3 <= n:
            a, b, j = f"n{k:03d}a", f"n{k:03d}b", f"n{k + 2:03d}"
            ids += [a, b, j]
            edges += [[prev, a], [prev, b], [a, j], [b, j]]
            prev = j
            continue
        node = f"n{k:03d}"
        if prev is not None:
            edges.append([prev, node])
        ids.append(node)
        prev = node
    nodes = [_node(i, "Layer") for i in ids]
    return {"nodes": nodes, "edges": edges, "roots": [ids[0]], "leaves": [ids[-1]], "order": ids}
