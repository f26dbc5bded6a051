"""Shared fixtures for the tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def store(tmp_path):
    from somatize import Store

    return Store(tmp_path / "store")
