"""An `Opaque` that wraps itself, directly or through others, has no value to hand on: it is
refused with a clear error, not unwrapped for ever."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _nodes import Same

from somatize import Graph, Opaque


def test_a_chain_of_opaques_that_ends_in_a_value_is_that_value():
    x = torch.arange(3.0)
    assert Graph.somatize(Same())(Opaque(Opaque(Opaque(x)))) is x


@pytest.mark.parametrize("loop", [1, 3])
def test_an_opaque_that_wraps_itself_is_refused_not_unwrapped_for_ever(loop):
    # run apart, so that a hang is a failed test rather than a stuck suite
    script = textwrap.dedent(
        f"""
        from somatize import Graph, Opaque
        from somatize.node import Node

        class Same(Node):
            def forward(self, input, ctx):
                return input

        ring = [Opaque(None) for _ in range({loop})]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            a.value = b
        try:
            Graph.somatize(Same())(Opaque(ring[0]))
        except ValueError as error:
            print(error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    assert "Opaques comes back on itself" in done.stdout, done.stdout
