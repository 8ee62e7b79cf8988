"""Grouped-query attention (Ainslie et al. 2023, "GQA", §2): key and value with fewer heads than the query, each
key/value head shared by a group of consecutive query heads, as ``enable_gqa`` of torch's
``scaled_dot_product_attention``."""

from __future__ import annotations

import torch

__all__ = ["expand_kv_heads"]


def expand_kv_heads(query: object, key: object, value: object, enable_gqa: object) -> tuple[object, object]:
    """``(key, value)`` with their heads repeated to the query's: query head ``h`` reads key/value head
    ``h // (Hq // Hkv)`` (``repeat_interleave`` along dim 1, a copy of O(B·Hq·Lk·D); gradients flow back summed
    over each group). Unchanged when ``enable_gqa`` is False, the head counts are equal, or the inputs are not 4-D
    tensors (the later checks name those).

    Raises:
        TypeError: ``enable_gqa`` is not a bool.
        ValueError: with ``enable_gqa=True``, key and value with different head counts, or a query head count that
            is not a multiple of theirs.
    """
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    tensors = (query, key, value)
    if not enable_gqa or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return key, value
    hq, hk, hv = (t.shape[1] for t in tensors)
    if hk != hv:
        raise ValueError(f"with enable_gqa=True key and value must have the same num_heads, got key {hk}, value {hv}")
    if hk == 0 or hq % hk:
        raise ValueError(
            f"enable_gqa=True needs the query's num_heads ({hq}) to be a multiple of the key's and value's ({hk})"
        )
    if hq == hk:
        return key, value
    group = hq // hk
    return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
