"""Shared test fixtures: a seed per test, one torch thread, small backend tiles on request."""

import os
import warnings

import pytest
import torch

from relbias.backends import blockwise, flex, structured

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the test shapes are tiny, and a second thread mostly waits (tests that need two set it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 8 keys (blockwise) and 8-query band tiles (structured), so small inputs span many
    tiles; FlexAttention eager (same score_mod / mask_mod, no compilation per shape)."""
    monkeypatch.setattr(blockwise, "BLOCK_Q", 8)
    monkeypatch.setattr(blockwise, "BLOCK_K", 8)
    monkeypatch.setattr(structured, "BLOCK_Q", 8)
    monkeypatch.setattr(flex, "COMPILE", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention warns that it is unfused
        yield
