"""Pytest setup: the repository root is importable (core, model, data), markers are registered."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "slow: multi-process or end-to-end test (still part of the suite)")


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
