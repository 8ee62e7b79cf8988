"""The native form of a bias: one value per head and per distinct offset of a (query, key) block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..positions import Alignment

__all__ = ["NativeBias"]


@dataclass(frozen=True)
class NativeBias:
    """A bias in its native per-offset form for one (query, key) block.

    Built by :meth:`relbias.RelativeBias.native`; backends look values up in it instead of
    materialising (H, Lq, Lk).

    Attributes:
        values: float tensor (H, num_offsets); ``values[h, n]`` is the bias of head ``h`` at offset
            ``min_offset + n`` (logits, before any scaling the score convention applies).
        alignment: the block's lengths and positions; ``alignment.min_offset`` is the offset of
            column 0.
    """

    values: torch.Tensor
    alignment: Alignment

    @property
    def min_offset(self) -> int:
        """Offset ``i - j`` (tokens) of column 0 of :attr:`values`."""
        return self.alignment.min_offset

    def materialize(self) -> torch.Tensor:
        """The (H, Lq, Lk) bias, same dtype and device as :attr:`values`: ``values[:, offsets - min_offset]``."""
        a = self.alignment
        index = a.offsets(self.values.device) - a.min_offset
        return self.values[:, index]
