"""Declarations a graph refuses when it is built, each with an error that names the node."""

from __future__ import annotations

import pytest
import torch
from _nodes import Add, Layer

from somatize import Graph


def test_the_cuts_own_names_are_not_node_ids():
    for name in ("<input>", "<loss>"):
        with pytest.raises(ValueError, match=f"'{name}' names a graph's own input or loss"):
            Add().named(name)
        g = Graph()
        with pytest.raises(ValueError, match=f"'{name}' names a graph's own input or loss"):
            g.node(name, Add())
        assert g.nodes() == []


def test_a_gpu_on_a_machine_without_cuda_is_refused_naming_the_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without
    layer = Layer(2, 2)
    with pytest.raises(ValueError) as refused:
        Graph.somatize(Add() >> layer.named("enc").on("cuda:0"))
    said = " ".join([str(refused.value), *getattr(refused.value, "__notes__", [])])
    assert "'enc'" in said and "cuda:0" in said and "no CUDA" in said
    assert layer.lin.weight.device.type == "cpu"  # nothing was moved
    # a node that runs on another host is placed there, not here
    g = Graph.somatize(Add() >> layer.named("far").on("cuda:0").at("gpu"))
    assert g.devices()["far"] == "cuda:0" and layer.lin.weight.device.type == "cpu"
