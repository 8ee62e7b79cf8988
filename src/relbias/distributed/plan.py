"""What the ring does with one (query piece, key piece) block: skip it, run it bias-free plus a constant, or
run it with the bias; and the counts a caller can read back.

A block is a run of consecutive queries at positions ``[qs, qs + lq)`` against a run of keys at
``[ks, ks + lk)``; its offsets ``i - j`` span ``[qs - (ks + lk - 1), qs + lq - 1 - ks]``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BLOCK_KINDS", "RingStats", "block_kind"]

#: "skip": causal and every key is in the future of every query (no work, no communication saved);
#: "past" / "future": every offset is ``>= T`` / ``<= -T`` of a far-constant bias, so the block runs
#: bias-free attention and adds the bias's constant at offset ``T`` / ``-T`` to its log-sum-exp;
#: "bias": the block runs single-device attention with the bias (or without, when there is none).
BLOCK_KINDS = ("skip", "past", "future", "bias")


def block_kind(
    query_start: int, query_len: int, key_start: int, key_len: int, *, is_causal: bool, far_distance: int | None
) -> str:
    """The kind (one of :data:`BLOCK_KINDS`) of a block of ``query_len`` queries against ``key_len`` keys.

    Args:
        query_start, key_start: absolute positions (tokens) of the block's first query and key.
        query_len, key_len: lengths (tokens), >= 1.
        is_causal: keys with offset < 0 are hidden.
        far_distance: T of a far-constant bias (``bias.far_constant_distance()``), or None.
    """
    min_offset = query_start - (key_start + key_len - 1)
    max_offset = query_start + query_len - 1 - key_start
    if is_causal and max_offset < 0:
        return "skip"
    if far_distance is not None:
        if min_offset >= far_distance:
            return "past"
        if not is_causal and max_offset <= -far_distance:
            return "future"
    return "bias"


@dataclass
class RingStats:
    """Counts of the forward pass's blocks, added to by :func:`relbias.distributed.context_parallel_attention`.

    One block is one (local query piece, travelling key piece) pair on this rank: per call, ``P`` ring
    steps times 1 (contiguous) or 4 (zigzag) pairs. Backward recomputes the same blocks and is not counted.

    Attributes:
        blocks: blocks considered.
        skipped: causal blocks entirely in the future, not run.
        bias_free: blocks entirely beyond a far-constant bias's distance, run bias-free plus a constant.
        biased: blocks run with the bias (or with no bias when there is none).
    """

    blocks: int = 0
    skipped: int = 0
    bias_free: int = 0
    biased: int = 0

    def add(self, kind: str) -> None:
        """Count one block of ``kind`` (one of :data:`BLOCK_KINDS`)."""
        self.blocks += 1
        if kind == "skip":
            self.skipped += 1
        elif kind == "bias":
            self.biased += 1
        else:
            self.bias_free += 1

    @property
    def bias_free_fraction(self) -> float:
        """``bias_free / (blocks - skipped)``: the share of the blocks that ran which ran bias-free (0.0 if none ran)."""
        ran = self.blocks - self.skipped
        return self.bias_free / ran if ran else 0.0
