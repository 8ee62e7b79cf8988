"""Fixtures for the hardening tests: one torch thread, small tiles, eager FlexAttention."""

from __future__ import annotations

import warnings

import pytest
import torch

from relbias.backends import blockwise, flex, structured

#: Every registered backend; the tests iterate over these names.
BACKEND_NAMES = ["reference", "blockwise", "structured", "flex"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the shapes are tiny and the machine is shared; a second thread only waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 x 8 (blockwise) and 8-query band tiles (structured), so that tiny inputs span several tiles,
    and FlexAttention eager (the same score_mod / mask_mod without a compilation per shape)."""
    monkeypatch.setattr(blockwise, "BLOCK_Q", 8)
    monkeypatch.setattr(blockwise, "BLOCK_K", 8)
    monkeypatch.setattr(structured, "BLOCK_Q", 8)
    monkeypatch.setattr(flex, "COMPILE", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention warns that it is unfused
        yield
