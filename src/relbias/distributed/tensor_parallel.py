"""A rank's heads of a replicated bias under tensor parallelism (Megatron-LM's column-parallel attention: each rank of
a tensor-parallel group computes a contiguous slice of the heads)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..biases.base import RelativeBias
from .comm import sum_gradients
from .groups import resolve_group
from .ulysses.heads import HeadSliceBias

__all__ = ["TensorParallelHeads", "rank_heads"]


def rank_heads(num_heads: int, group) -> tuple[int, int]:
    """``[start, stop)``: the heads rank r of a tensor-parallel group of size T computes, ``[r·H/T, (r+1)·H/T)``
    (what a column-wise sharded q/k/v projection leaves it).

    Raises:
        ValueError: ``num_heads`` not divisible by T.
    """
    group = resolve_group(group, argument="tensor_parallel")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_heads % size:
        raise ValueError(
            f"tensor parallelism over {size} ranks shards the {num_heads} heads column-wise, so num_heads must be "
            f"divisible by {size}; {num_heads} % {size} = {num_heads % size}"
        )
    per = num_heads // size
    return rank * per, (rank + 1) * per


class TensorParallelHeads(HeadSliceBias):
    """Heads ``[start, stop)`` of a bias replicated over a tensor-parallel group, whose parameters' gradients come back
    whole on every rank.

    Values are the parent's for those heads (:class:`relbias.distributed.HeadSliceBias`); in backward the gradient
    of the parent's values (every head: zero outside this rank's) is summed over ``group`` before it reaches the
    parameters, so each rank's table gradient is every rank's heads' (what one process computes), with no reduction
    left to the caller. Every rank of the group must run the same calls (tensor-parallel ranks see the same tokens).

    Args:
        bias: the parent :class:`relbias.RelativeBias` (num_heads H > 1), replicated on every rank.
        start, stop: this rank's heads (:func:`rank_heads`).
        group: the tensor-parallel process group (None: the default group).
        sync_grads: False leaves each rank the gradient of its own heads' values (zero elsewhere).
    """

    def __init__(self, bias: RelativeBias, start: int, stop: int, group=None, sync_grads: bool = True) -> None:
        super().__init__(bias, start, stop)
        self.group, self.sync_grads = group, sync_grads

    def _all(self, values: torch.Tensor) -> torch.Tensor:
        if self.sync_grads and torch.is_grad_enabled() and values.requires_grad:
            values = sum_gradients(values, self.group, "the all-reduce of the bias values' gradients over the "
                                                         "tensor-parallel group")
        return values[self.start : self.stop]

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        """The parent's values at ``offsets`` for this rank's heads: ``(stop - start, *S)``."""
        return self._all(self.parent.offset_values(offsets))

    def pair_values(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The parent's pair values for this rank's heads: (stop - start, Tq, Tk)."""
        return self._all(self.parent.pair_values(query_positions, key_positions))
