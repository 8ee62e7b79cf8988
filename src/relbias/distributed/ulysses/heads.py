"""A view of some heads of a bias module: what DeepSpeed-Ulysses needs once heads are sharded over ranks."""

from __future__ import annotations

import torch

from ..._int_args import check_int
from ...biases.base import RelativeBias

__all__ = ["HeadSliceBias", "slice_heads"]


class HeadSliceBias(RelativeBias):
    """Heads ``[start, stop)`` of a bias module, sharing its parameters (gradients reach the parent's).

    Every method returns the parent's values restricted to those heads: ``offset_values`` and
    ``pair_values`` give (stop - start, ...). The family's settings (``bidirectional``, ``default_convention``,
    ``offset_only``, ``distance_only``, :meth:`far_constant_distance`, :meth:`parameter_key`) are the
    parent's. Use :func:`slice_heads`, which returns the parent itself for a one-head (shared) bias.

    Args:
        bias: the parent :class:`relbias.RelativeBias`, ``num_heads`` > 1.
        start, stop: head range, ``0 <= start < stop <= bias.num_heads``.

    Raises:
        TypeError: ``bias`` is not a RelativeBias; non-int bounds.
        ValueError: an empty or out-of-range head range.
    """

    def __init__(self, bias: RelativeBias, start: int, stop: int) -> None:
        super().__init__()
        if not isinstance(bias, RelativeBias):
            raise TypeError(f"bias must be a RelativeBias module, got {type(bias).__name__}")
        check_int("start", start, minimum=0)
        check_int("stop", stop, minimum=0)
        if not start < stop <= bias.num_heads:
            raise ValueError(f"head range [{start}, {stop}) is empty or outside the bias's {bias.num_heads} heads")
        self.parent = bias
        self.start, self.stop = start, stop
        self.num_heads = stop - start
        self.bidirectional = bias.bidirectional
        self.default_convention = bias.default_convention
        self.offset_only = bias.offset_only
        self.distance_only = bias.distance_only

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        """The parent's values at ``offsets`` for the sliced heads: ``(stop - start, *S)``."""
        return self.parent.offset_values(offsets)[self.start : self.stop]

    def pair_values(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The parent's pair values for the sliced heads: (stop - start, Tq, Tk)."""
        return self.parent.pair_values(query_positions, key_positions)[self.start : self.stop]

    def far_constant_distance(self) -> int | None:
        return self.parent.far_constant_distance()

    def parameter_key(self, offsets: torch.Tensor) -> torch.Tensor:
        return self.parent.parameter_key(offsets)

    def distance(self, offsets: torch.Tensor) -> torch.Tensor:
        return self.parent.distance(offsets)

    def extra_repr(self) -> str:
        return f"heads=[{self.start}, {self.stop})"


def slice_heads(bias: RelativeBias | None, start: int, stop: int) -> RelativeBias | None:
    """Heads ``[start, stop)`` of ``bias``: None for None, ``bias`` itself when it has one (shared) head, else a
    :class:`HeadSliceBias`."""
    if bias is None or bias.num_heads == 1:
        return bias
    return HeadSliceBias(bias, start, stop)
