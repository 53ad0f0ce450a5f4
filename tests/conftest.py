"""Pytest setup: GPU tests are skipped without CUDA (markers and the import path are in pyproject.toml)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_SLOW_TIERS = ("multiproc", "e2e")   # spawned ranks or torchrun: not in the fast tier (`-m "not slow"`)


def pytest_itemcollected(item):
    if any(f"tests/{tier}/" in item.nodeid for tier in _SLOW_TIERS):
        item.add_marker(pytest.mark.slow)
