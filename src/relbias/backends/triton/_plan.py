"""What the Triton kernels need to know about one call besides its tensors, and the launch settings derived from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Plan", "block_dim", "precision"]


@dataclass(frozen=True)
class Plan:
    """Settings of one Triton attention call.

    Attributes:
        scale: multiplier of ``q . k``; bias_scale: multiplier of the bias (the convention's).
        is_causal: hide keys with ``j > i + delta``.
        delta: ``query_start - key_start`` (tokens; 0 for packed sequences).
        query_pos, key_pos: absolute positions (tokens) of the first query and key, for the dropout mask.
        dropout_p: drop probability, 0 for none.
        seeds: None, or int32 (N,) on the inputs' device: the dropout seed of each packed sequence.
        batch_seed: the dropout seed of a batch call (31 bits; 0 without dropout).
        cu_seqlens: None, or int32 (N + 1,) on the device: the packed sequences' boundaries.
        max_len: the longest packed sequence (tokens); 0 for a batch.
        block: query and key rows per tile (tokens; a power of two, at least 16).
    """

    scale: float
    bias_scale: float
    is_causal: bool
    delta: int
    query_pos: int
    key_pos: int
    dropout_p: float
    seeds: torch.Tensor | None
    batch_seed: int
    cu_seqlens: torch.Tensor | None
    max_len: int
    block: int

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    def sequences(self, query: torch.Tensor) -> int:
        """Programs along the kernels' sequence axis: packed sequences, or batch entries."""
        return self.cu_seqlens.numel() - 1 if self.varlen else query.shape[0]

    def tiles(self, length: int) -> int:
        """Tiles along a query or key axis of ``length`` rows (the longest packed sequence's when packed)."""
        return -(-(self.max_len if self.varlen else length) // self.block)

    def value_offset(self, key_len: int) -> int:
        """Column of the per-offset values read by query 0 and key 0 (``values[h, i - j + value_offset]``)."""
        return (self.max_len if self.varlen else key_len) - 1

    def pointers(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(boundaries, per-sequence seeds): the tensors the kernels read for packed sequences, ``placeholder`` (any
        tensor on the device, never read) where there are none: a batch call allocates and copies nothing."""
        seeds = self.seeds if self.varlen and self.seeds is not None else placeholder
        return (self.cu_seqlens if self.varlen else placeholder), seeds

    def dropout_scalars(self) -> tuple[int, float, int]:
        """(threshold ``p * 2**32``, keep scale ``1 / (1 - p)``, a batch's seed); zeros and 1 without dropout."""
        if self.dropout_p == 0:
            return 0, 1.0, 0
        return int(self.dropout_p * 2**32), 1.0 / (1.0 - self.dropout_p), self.batch_seed


def block_dim(n: int) -> int:
    """Tile width for a head_dim of ``n``: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << (n - 1).bit_length())


def precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s input precision: float32 inputs are multiplied in full float32 ("ieee", not TF32); half types
    take triton's default (None)."""
    return "ieee" if dtype == torch.float32 else None
