"""Sharding helpers and block kinds (single process, no process group)."""

from __future__ import annotations

import pytest
import torch

from relbias.distributed import block_kind, shard, shard_pieces, shard_positions, unshard
from relbias.distributed.layout import layout_order


def test_zigzag_positions_of_the_docstring():
    assert shard_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 2, 1).tolist() == [4, 5, 6, 7]
    assert shard_pieces(24, 3, 1, "zigzag") == [(4, 4), (16, 4)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shard_unshard_round_trip(layout, world_size):
    full = torch.randn(2, 3, 32, 5)
    shards = [shard(full, world_size, r, layout=layout) for r in range(world_size)]
    for r, s in enumerate(shards):
        assert torch.equal(s, full[:, :, shard_positions(32, world_size, r, layout)])
    assert torch.equal(unshard(shards, layout=layout), full)
    mask = torch.rand(2, 1, 1, 32) > 0.5
    mask_shards = [shard(mask, world_size, r, layout=layout, dim=-1) for r in range(world_size)]
    assert torch.equal(unshard(mask_shards, layout=layout, dim=-1), mask)
    assert torch.equal(full.index_select(2, layout_order(32, world_size, layout)), torch.cat(shards, dim=2))


def test_every_position_once():
    for layout in ("contiguous", "zigzag"):
        got = torch.cat([shard_positions(48, 4, r, layout) for r in range(4)]).sort().values
        assert torch.equal(got, torch.arange(48))


def test_lengths_not_divisible_are_refused_with_the_values():
    with pytest.raises(ValueError, match=r"length 30 is not divisible by 8.*pad it to 32"):
        shard(torch.zeros(1, 1, 30, 2), 4, 0, layout="zigzag")
    with pytest.raises(ValueError, match=r"length 10 is not divisible by 4"):
        shard_pieces(10, 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(torch.zeros(1, 1, 8, 2), 2, 0, layout="striped")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        shard_pieces(8, 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        unshard([torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 2, 2)])
    with pytest.raises(ValueError, match="even"):
        unshard([torch.zeros(1, 1, 3, 2)] * 2, layout="zigzag")


def test_block_kinds():
    # queries 32..47 against keys 0..15: offsets 17..47
    assert block_kind(32, 16, 0, 16, is_causal=True, far_distance=17) == "past"
    assert block_kind(32, 16, 0, 16, is_causal=True, far_distance=18) == "bias"
    assert block_kind(0, 16, 32, 16, is_causal=True, far_distance=8) == "skip"
    assert block_kind(0, 16, 32, 16, is_causal=False, far_distance=8) == "future"
    assert block_kind(0, 16, 32, 16, is_causal=False, far_distance=None) == "bias"
    assert block_kind(0, 16, 16, 16, is_causal=True, far_distance=None) == "skip"
    assert block_kind(0, 16, 15, 16, is_causal=True, far_distance=None) == "bias"  # key 15 is visible to query 15


def test_block_kinds_under_a_window():
    # queries 32..47 against keys 0..15: offsets 17..47
    assert block_kind(32, 16, 0, 16, is_causal=True, far_distance=None, window=(16, 0)) == "skip"  # all beyond 16
    assert block_kind(32, 16, 0, 16, is_causal=True, far_distance=None, window=(17, 0)) == "bias"  # query 32, key 15
    # far-constant blocks run bias-free only when the window hides none of their keys
    assert block_kind(32, 16, 0, 16, is_causal=True, far_distance=17, window=(47, 0)) == "past"
    assert block_kind(32, 16, 0, 16, is_causal=True, far_distance=17, window=(46, 0)) == "bias"
    # keys 32..47 ahead of queries 0..15 (offsets -47..-17): a right side of 16 reaches none, of 17 one pair
    assert block_kind(0, 16, 32, 16, is_causal=False, far_distance=8, window=(None, 16)) == "skip"
    assert block_kind(0, 16, 32, 16, is_causal=False, far_distance=8, window=(None, 17)) == "bias"
    assert block_kind(0, 16, 32, 16, is_causal=False, far_distance=8, window=(None, 47)) == "future"
