"""FlexAttention block masks built in O(B·H·L·block) memory.

``torch.nn.attention.flex_attention.create_block_mask`` evaluates ``mask_mod`` over the whole
(Lq, Lk) grid at once when not compiled (hundreds of MiB at L = 4096 with a causal offset). Here the
visibility of each (query block, key block) tile is computed one row of blocks at a time from the same
rule the backend's ``mask_mod`` applies, and handed to ``BlockMask.from_kv_blocks``: a block with some
visible entry is "partial" (mask_mod applied per entry), one with every entry visible is "full".
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "block_mask"]

#: Tile side of the block mask (tokens), FlexAttention's default.
BLOCK = 128


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (..., nQ) int32, indices (..., nQ, nK) int32 with the True blocks first) of a dense block mask."""
    count = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, indices


def block_mask(mask_mod, visible_rows, batch: int, heads: int, query_len: int, key_len: int, device):
    """The BlockMask of ``mask_mod`` for padded lengths ``query_len`` x ``key_len``.

    Args:
        mask_mod: the kernel's per-entry rule (b, h, q_idx, kv_idx) -> bool.
        visible_rows: ``f(t0, t1) -> bool (batch or 1, heads or 1, t1 - t0, key_len)``, the same rule for
            query rows t0:t1 (tensor ops, no vmap).
        batch, heads: sizes of the mask's batch and head dimensions (1 when it broadcasts).
        query_len, key_len: the padded lengths (tokens).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_k = -(-query_len // BLOCK), -(-key_len // BLOCK)
    partial = torch.zeros(batch, heads, n_q, n_k, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    pad_k = n_k * BLOCK - key_len
    for j in range(n_q):
        t0, t1 = j * BLOCK, min(query_len, (j + 1) * BLOCK)
        rows = visible_rows(t0, t1).expand(batch, heads, t1 - t0, key_len)
        if pad_k:  # entries beyond the keys: hidden
            rows = torch.nn.functional.pad(rows, (0, pad_k), value=False)
        tiles = rows.reshape(batch, heads, t1 - t0, n_k, BLOCK)
        some, every = tiles.any(dim=(2, 4)), tiles.all(dim=(2, 4))
        partial[:, :, j], full[:, :, j] = some & ~every, every
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(query_len, key_len)
    )
