"""The ring's travelling chunks: how many (``resolve_kv_chunks``) and which positions each holds (``kv_chunks_of``)."""

from __future__ import annotations

import pytest

from relbias.distributed import shard_pieces
from relbias.distributed.ring.plan import MIN_AUTO_CHUNK_TOKENS, kv_chunks_of, resolve_kv_chunks


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunks_cover_the_shard_once_in_runs_of_consecutive_positions(layout, chunks):
    seq_len, world_size, rank = 96, 3, 1
    pieces = shard_pieces(seq_len, world_size, rank, layout)
    held = [p for start, n in pieces for p in range(start, start + n)]  # global position of each local row
    seen = []
    for keys, starts in kv_chunks_of(pieces, chunks):
        rows = held[keys]
        run = len(rows) // len(starts)
        # the chunk's rows are its runs, each of consecutive positions from its start
        assert rows == [s + i for s in starts for i in range(run)]
        seen += rows
    assert seen == held
    assert len(kv_chunks_of(pieces, chunks)) == chunks


def test_automatic_chunks():
    big = 4 * MIN_AUTO_CHUNK_TOKENS
    assert resolve_kv_chunks(None, big, 1, world_size=1) == 1  # nothing travels on one rank
    assert resolve_kv_chunks(None, big, 1, world_size=4) == 4
    assert resolve_kv_chunks(None, big, 2, world_size=4) == 4  # 2 pieces of 2 chunks, each big / 4 tokens
    assert resolve_kv_chunks(None, 2 * MIN_AUTO_CHUNK_TOKENS, 1, world_size=2) == 2  # 4 would be too short
    assert resolve_kv_chunks(None, 2 * MIN_AUTO_CHUNK_TOKENS, 2, world_size=2) == 2  # one chunk per piece
    assert resolve_kv_chunks(None, MIN_AUTO_CHUNK_TOKENS, 2, world_size=2) == 1
    assert resolve_kv_chunks(None, 64, 1, world_size=4) == 1
    odd = 4 * MIN_AUTO_CHUNK_TOKENS + 2  # 2 pieces of an odd length: not 4 chunks, but one per piece
    assert resolve_kv_chunks(None, odd, 2, world_size=2) == 2


def test_explicit_chunks_are_checked():
    assert resolve_kv_chunks(6, 12, 2, world_size=2) == 6
    assert resolve_kv_chunks(1, 6, 2, world_size=2) == 1
    with pytest.raises(ValueError, match=r"kv_chunks=3 cannot split .* 2 run\(s\) of 6 .* one of 1, 2, 4, 6, 12$"):
        resolve_kv_chunks(3, 12, 2, world_size=2)
    with pytest.raises(ValueError, match=r"kv_chunks=4 cannot split .* 1 run\(s\) of 6 .* one of 1, 2, 3, 6$"):
        resolve_kv_chunks(4, 6, 1, world_size=2)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        resolve_kv_chunks(0, 6, 1, world_size=2)
    with pytest.raises(TypeError, match="kv_chunks must be an int"):
        resolve_kv_chunks(True, 6, 1, world_size=2)
