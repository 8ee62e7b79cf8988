"""The band of a local-attention window written out independently of relbias: the mask the window tests compare
every backend, layer and cache against."""

from __future__ import annotations

import torch


def band(lq, lk, query_start, key_start, window, is_causal):
    """(Lq, Lk) bool, True = may attend: keys ``i - left <= j <= i + right`` (and ``j <= i`` when causal), at absolute
    positions (``query_start`` None: queries aligned to the last keys)."""
    query_start = key_start + lk - lq if query_start is None else query_start
    i = torch.arange(lq)[:, None] + query_start
    j = torch.arange(lk)[None, :] + key_start
    left, right = window
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    if is_causal:
        keep &= j <= i
    return keep
