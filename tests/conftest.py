"""Shared fixtures for the tests, and a header line saying which kernels ran them."""

from __future__ import annotations

import pytest


def pytest_report_header(config):
    """Which BLAS kernel numpy runs and how torch runs (`make test-portable` changes both):
    a float that passes here and fails there owes its value to this machine's rounding."""
    lines = []
    try:
        import numpy  # noqa: F401  (loads its BLAS, so threadpoolctl can see it)
        from threadpoolctl import threadpool_info

        for pool in threadpool_info():
            if pool.get("user_api") == "blas":
                kernel = pool.get("architecture") or "?"
                lines.append(
                    f"numpy's BLAS: {pool['internal_api']} {kernel}, {pool['num_threads']} threads"
                )
    except ImportError:
        pass
    try:
        import torch

        lines.append(
            f"torch {torch.__version__}: {torch.backends.cpu.get_cpu_capability()} kernels, "
            f"{torch.get_num_threads()} threads"
        )
    except ImportError:
        pass
    return lines


@pytest.fixture
def store(tmp_path):
    from somatize import Store

    return Store(tmp_path / "store")
