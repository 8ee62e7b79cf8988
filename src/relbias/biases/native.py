"""The native form of a bias: one value per head and per distinct offset of a (query, key) block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
    #: What a backend derives from :attr:`values` (e.g. the reversed, scaled copy), kept with the values it
    #: came from: a reused native form (:meth:`relbias.RelativeBias.native` outside autograd) reuses them too.
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    def derive(self, key: object, make: Callable[[], object]) -> object:
        """``make()`` (a tensor, or a tuple holding tensors), computed once per ``key`` (hashable) for these values;
        callers must not modify it."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = make()
        return value

    @property
    def min_offset(self) -> int:
        """Offset ``i - j`` (tokens) of column 0 of :attr:`values`."""
        return self.alignment.min_offset

    def materialize(self) -> torch.Tensor:
        """The (H, Lq, Lk) bias, same dtype and device as :attr:`values`: ``values[:, offsets - min_offset]``."""
        a = self.alignment
        index = a.offsets(self.values.device) - a.min_offset
        return self.values[:, index]
