"""The toeplitz backend's bias view: per-offset values reversed, read with strides (1, 1) against query rows taken in
reverse order (see :mod:`relbias.backends.toeplitz`), and the causal key ranges of a query block."""

from __future__ import annotations

import torch

__all__ = ["block_mask", "future_offsets", "key_end", "reversed_bias"]

_NEG_INF = float("-inf")


def block_mask(w: torch.Tensor, query_len: int, i0: int, i1: int, k0: int, k1: int) -> torch.Tensor:
    """(1, Hb, i1 - i0, k1 - k0) view of the reversed bias ``w`` (Hb, Lq + Lk - 1) for query rows i1-1 down to
    i0 (row a is query i1 - 1 - a) and keys k0:k1: entry (a, s) is ``w[Lq - i1 + a + k0 + s]``."""
    return w.as_strided(
        (1, w.shape[0], i1 - i0, k1 - k0), (0, w.stride(0), 1, 1), w.storage_offset() + query_len - i1 + k0
    )


def key_end(i1: int, delta: int, key_len: int, is_causal: bool) -> int:
    """Keys 0:end that query rows below ``i1`` may see (causal: key s visible to query t when s <= t + delta)."""
    return min(key_len, max(0, i1 + delta)) if is_causal else key_len


def future_offsets(values: torch.Tensor, delta: int, key_len: int) -> torch.Tensor:
    """(M,) bool: the columns of the per-offset ``values`` (Hb, M) whose offset ``i - j`` is negative (future keys).
    Column n has offset ``min_offset + n``, with ``min_offset = delta - (key_len - 1)`` (first query, last key)."""
    return torch.arange(values.shape[1], device=values.device) < key_len - 1 - delta


def reversed_bias(values: torch.Tensor, dtype: torch.dtype, bias_scale: float, is_causal: bool, delta: int,
                   key_len: int) -> torch.Tensor:
    """``w`` (Hb, M) in ``dtype``: the scaled per-offset values reversed; causal: future offsets (< 0) -inf."""
    w = values.to(dtype) * bias_scale
    if is_causal:
        w = w.masked_fill(future_offsets(w, delta, key_len), _NEG_INF)
    return w.flip(-1).contiguous()
