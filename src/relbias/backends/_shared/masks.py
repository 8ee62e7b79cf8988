"""A bool key padding mask as the additive row the fused kernels read (PyTorch's CPU flash kernel's attn_mask, the
toeplitz kernels' padding row)."""

from __future__ import annotations

import torch

__all__ = ["additive_mask"]


def additive_mask(keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(Bm, Hm, 1, keys) in ``dtype``, 0 where ``keep`` (a (Bm, Hm, keys) bool key mask, True = may attend) holds and
    -inf where it does not, a view of a contiguous (Bm, Hm, keys) tensor; None for None."""
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))[:, :, None]
