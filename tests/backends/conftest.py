"""Fixtures for the backend tests."""

from __future__ import annotations

import warnings

import pytest

from relbias.backends import blockwise, flex, structured


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
