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


@pytest.fixture
def llamapipe_log():
    """The messages the `llamapipe` logger emits during the test, in order, each once. A handler on the logger
    itself, not caplog: pytest 9's caplog.at_level(logger=...) also hooks the named logger, so records that
    propagate to caplog's root handler were seen twice there (pytest 8 saw them once)."""
    import logging
    from llamapipe.core.logger import get_logger
    messages: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = get_logger()
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
