"""What the Triton kernels need to know about one call besides its tensors, and the launch settings derived from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Plan", "block_dim", "launch_args", "precision"]


@dataclass(frozen=True)
class Plan:
    """Settings of one Triton attention call.

    Attributes:
        scale: multiplier of ``q . k``; bias_scale: multiplier of the bias (the convention's).
        band: ``(lo, hi)``, the offsets ``lo <= i - j <= hi`` (i, j absolute positions) a query may see: the causal
            rule (lo 0) and a local-attention window folded (:attr:`relbias.call.AttentionCall.offset_band`); a side
            is None where it hides no entry of the call, so no kernel compares against it.
        delta: ``query_start - key_start`` (tokens; 0 for packed sequences).
        query_pos, key_pos: absolute positions (tokens) of the first query and key, for the dropout mask.
        dropout_p: drop probability, 0 for none.
        seeds: None, or int32 (N,) on the inputs' device: the dropout seed of each packed sequence; for a batch
            call, None, or int32 (1,) on the device: its seed drawn in a compiled graph, read by the kernels (no
            value leaves the device).
        batch_seed: the dropout seed of a batch call (31 bits; 0 without dropout or with ``seeds``).
        cu_seqlens: None, or int32 (N + 1,) on the device: the packed sequences' boundaries.
        max_len: the longest packed sequence (tokens); 0 for a batch.
        block: query and key rows per tile (tokens; a power of two, at least 16).
    """

    scale: float
    bias_scale: float
    band: tuple[int | None, int | None]
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

    def bands(self, query_len: int, key_len: int) -> tuple[int, int]:
        """``(first, stop)``: the range of ``query tile - key tile`` whose tiles hold some offset of :attr:`band`
        (tile r holds ``r * block - (block - 1) + delta`` to ``r * block + block - 1 + delta``); ``first >= stop``
        when none does."""
        n = self.block
        first, stop = -(self.tiles(key_len) - 1), self.tiles(query_len)
        lo, hi = self.band
        if lo is not None:  # largest offset >= lo
            first = max(first, -((self.delta + n - 1 - lo) // n))
        if hi is not None:  # smallest offset <= hi
            stop = min(stop, (hi - self.delta + n - 1) // n + 1)
        return first, stop

    def value_offset(self, key_len: int) -> int:
        """Column of the per-offset values read by query 0 and key 0 (``values[h, i - j + value_offset]``)."""
        return (self.max_len if self.varlen else key_len) - 1

    def pointers(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(boundaries, seeds): the tensors the kernels read for packed sequences and a seed drawn on the device,
        ``placeholder`` (any tensor on the device, never read) where there are none: an eager batch call allocates
        and copies nothing."""
        seeds = self.seeds if self.seeds is not None else placeholder
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


def launch_args(plan: Plan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                lse: torch.Tensor, w: torch.Tensor, padding: torch.Tensor | None) -> tuple[list, list, dict]:
    """What every kernel takes besides its own tensors, in the kernels' order: the pointers (``w``, the padding
    rows, the packed boundaries, the packed seeds; ``w`` stands in for those a call has not), the scalars (strides of
    query, key, value, ``rows`` (the output in the forward, its gradient in the backward) and ``lse``, of ``w`` and
    the padding across heads and batch (0 where shared), sizes, settings) and the compile-time constants."""
    _, _, lq, d = query.shape
    lk, dv = key.shape[2], value.shape[-1]
    threshold, keep_scale, batch_seed = plan.dropout_scalars()
    pad_strides = (0, 0)
    if padding is not None:  # 0 across a dimension of size 1: the same row for every batch entry or head
        pad_strides = tuple(padding.stride(i) if padding.shape[i] > 1 else 0 for i in (0, 1))
    pointers = [w, w if padding is None else padding, *plan.pointers(w)]
    lo, hi = plan.band
    args = [
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *rows.stride()[:3], *lse.stride()[:2],
        w.stride(0) if w.shape[0] > 1 else 0, *pad_strides,
        lq, lk, d, dv, plan.scale, plan.bias_scale, plan.delta, plan.value_offset(lk), 0 if lo is None else lo,
        0 if hi is None else hi, plan.query_pos, plan.key_pos, threshold, keep_scale, batch_seed,
    ]
    meta = dict(HAS_LO=lo is not None, HAS_HI=hi is not None, HAS_PAD=padding is not None,
                HAS_DROPOUT=plan.dropout_p > 0, IS_VARLEN=plan.varlen,
                SEED_IN_MEMORY=plan.dropout_p > 0 and not plan.varlen and plan.seeds is not None,
                BLOCK=plan.block, BLOCK_D=block_dim(d),
                BLOCK_DV=block_dim(dv), PRECISION=precision(query.dtype))
    return pointers, args, meta
