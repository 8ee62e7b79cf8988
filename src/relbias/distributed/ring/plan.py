"""What the ring does with one (query piece, key piece) block: skip it, run it bias-free plus a constant, or
run it with the bias; and the counts a caller can read back.

A block is a run of consecutive queries at positions ``[qs, qs + lq)`` against a run of keys at
``[ks, ks + lk)``; its offsets ``i - j`` span ``[qs - (ks + lk - 1), qs + lq - 1 - ks]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..._int_args import check_int
from ...window import offset_band

__all__ = ["BLOCK_KINDS", "MAX_AUTO_KV_CHUNKS", "MIN_AUTO_CHUNK_TOKENS", "RingStats", "block_kind", "kv_chunks_of",
           "resolve_kv_chunks"]

#: "skip": every key is in the future of every query (causal) or outside every query's window (no work, no
#: communication saved);
#: "past" / "future": every offset is ``>= T`` / ``<= -T`` of a far-constant bias, so the block runs
#: bias-free attention and adds the bias's constant at offset ``T`` / ``-T`` to its log-sum-exp;
#: "bias": the block runs single-device attention with the bias (or without, when there is none).
BLOCK_KINDS = ("skip", "past", "future", "bias")


def block_kind(
    query_start: int, query_len: int, key_start: int, key_len: int, *, is_causal: bool, far_distance: int | None,
    window: tuple[int | None, int | None] | None = None,
) -> str:
    """The kind (one of ``BLOCK_KINDS``: "skip", "past", "future" or "bias") of a block of ``query_len`` queries against ``key_len`` keys.

    Args:
        query_start, key_start: absolute positions (tokens) of the block's first query and key.
        query_len, key_len: lengths (tokens), >= 1.
        is_causal: keys with offset < 0 are hidden.
        far_distance: T of a far-constant bias (``bias.far_constant_distance()``), or None.
        window: None or a local-attention window ``(left, right)`` (:mod:`relbias.window`): a block wholly outside
            its band is skipped, and one that it cuts runs with the bias (and the window).
    """
    min_offset = query_start - (key_start + key_len - 1)
    max_offset = query_start + query_len - 1 - key_start
    lo, hi = offset_band(window, is_causal)
    if (lo is not None and max_offset < lo) or (hi is not None and min_offset > hi):
        return "skip"
    if (lo is not None and min_offset < lo) or (hi is not None and max_offset > hi):
        return "bias"  # some of its keys are hidden from some query: not bias-free attention over all of them
    if far_distance is not None:
        if min_offset >= far_distance:
            return "past"
        if not is_causal and max_offset <= -far_distance:
            return "future"
    return "bias"


#: ``kv_chunks=None`` splits a shard into at most this many travelling chunks ...
MAX_AUTO_KV_CHUNKS = 4
#: ... each at least this many tokens long (shorter ones would make the ring's steps small and many).
MIN_AUTO_CHUNK_TOKENS = 256


def resolve_kv_chunks(kv_chunks: object, local_len: int, num_pieces: int, world_size: int) -> int:
    """The number C of chunks a shard's keys and values travel the ring in, one full rotation per chunk.

    Args:
        kv_chunks: None (automatic: 1 on one rank, where nothing travels; else the largest C of 4, 2, 1 whose
            chunks are whole and at least :data:`MIN_AUTO_CHUNK_TOKENS` tokens) or an int >= 1: 1 (the whole shard,
            every piece, travels at once), or a multiple of ``num_pieces`` whose chunks split every piece evenly.
        local_len: L/P, tokens per rank; num_pieces: runs of positions per shard (1 contiguous, 2 zigzag).
        world_size: P.

    Raises:
        TypeError: ``kv_chunks`` is neither None nor an int.
        ValueError: ``kv_chunks < 1``; C > 1 not a multiple of ``num_pieces`` or not dividing the pieces evenly.
    """
    piece = local_len // num_pieces
    if kv_chunks is None:
        if world_size == 1:
            return 1
        for chunks in (MAX_AUTO_KV_CHUNKS, 2):
            size = _chunk_tokens(chunks, piece, num_pieces)
            if size is not None and size >= MIN_AUTO_CHUNK_TOKENS:
                return chunks
        return 1
    check_int("kv_chunks", kv_chunks, minimum=1)
    if _chunk_tokens(kv_chunks, piece, num_pieces) is None:
        divisors = {d for n in range(1, math.isqrt(piece) + 1) if piece % n == 0 for d in (n, piece // n)}
        valid = sorted({1} | {num_pieces * d for d in divisors})
        shown = ", ".join(map(str, valid if len(valid) <= 12 else valid[:11] + ["...", valid[-1]]))
        rule = f"a divisor of {piece}" if num_pieces == 1 else f"1 or {num_pieces} x a divisor of {piece}"
        raise ValueError(
            f"kv_chunks={kv_chunks} cannot split this rank's {num_pieces} run(s) of {piece} consecutive positions into "
            f"equal chunks (each within one run); kv_chunks must be {rule}: one of {shown}"
        )
    return kv_chunks


def _chunk_tokens(chunks: int, piece: int, num_pieces: int) -> int | None:
    """Tokens per chunk when ``chunks`` splits a shard of ``num_pieces`` runs of ``piece`` positions: 1 chunk is the
    whole shard; more must split every run into as many equal chunks. None where they do not."""
    if chunks == 1:
        return piece * num_pieces
    per_piece, left = divmod(chunks, num_pieces)
    return piece // per_piece if not left and piece % per_piece == 0 else None


def kv_chunks_of(pieces: list[tuple[int, int]], chunks: int) -> list[tuple[slice, list[int]]]:
    """The travelling chunks of a shard whose runs of positions are ``pieces`` ([(start, length), ...], local
    order): ``(local slice, [start of each run in it])`` per chunk, ``chunks`` of them (:func:`resolve_kv_chunks`).
    One chunk is the whole shard, all its runs; more split each run into ``chunks / len(pieces)`` equal parts."""
    if chunks == 1:
        return [(slice(0, sum(n for _, n in pieces)), [start for start, _ in pieces])]
    per_piece = chunks // len(pieces)
    out, at = [], 0
    for start, length in pieces:
        size = length // per_piece
        for part in range(per_piece):
            out.append((slice(at + part * size, at + (part + 1) * size), [start + part * size]))
        at += length
    return out


@dataclass
class RingStats:
    """Counts of a context-parallel call's blocks and traffic, added to by
    :func:`relbias.distributed.context_parallel_attention` (strategies "ring" and "halo"; "ulysses" adds nothing).

    One block is one (local query piece, key piece) pair on this rank. "ring": per call, ``P`` ring steps per
    travelling chunk (``kv_chunks`` C), each with 1 (contiguous) or 2 (zigzag) query pieces against the chunk's key
    pieces (C = 1: 1 contiguous, 2 zigzag; C > 1: one piece per chunk). "halo": the shard's own block and one block
    per side whose halo holds keys. Backward revisits the same blocks and is not counted.

    Traffic is the bytes of the point-to-point messages this rank posts (keys, values, piece starts, mask slices
    as one byte per element; in backward the key and value gradients, in the compute dtype: float32 for half
    precision). The small collectives around them (one ``all_gather`` of the settings per call, the bias gradients'
    ``all_reduce`` of O(parameters)) are not counted.

    Attributes:
        blocks: blocks considered.
        skipped: blocks entirely in the future (causal) or outside the window, not run.
        bias_free: blocks entirely beyond a far-constant bias's distance, run bias-free plus a constant.
        biased: blocks run with the bias (or with no bias when there is none).
        sent_bytes, received_bytes: bytes this rank sent and received in forward.
        backward_sent_bytes, backward_received_bytes: the same in backward.
    """

    blocks: int = 0
    skipped: int = 0
    bias_free: int = 0
    biased: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    backward_sent_bytes: int = 0
    backward_received_bytes: int = 0

    def add(self, kind: str) -> None:
        """Count one block of ``kind`` (one of ``BLOCK_KINDS``: "skip", "past", "future" or "bias")."""
        self.blocks += 1
        if kind == "skip":
            self.skipped += 1
        elif kind == "bias":
            self.biased += 1
        else:
            self.bias_free += 1

    def add_traffic(self, sent: int, received: int, *, backward: bool = False) -> None:
        """Count ``sent`` and ``received`` bytes of one exchange, of backward when ``backward``."""
        if backward:
            self.backward_sent_bytes += sent
            self.backward_received_bytes += received
        else:
            self.sent_bytes += sent
            self.received_bytes += received

    @property
    def bias_free_fraction(self) -> float:
        """``bias_free / (blocks - skipped)``: the share of the blocks that ran which ran bias-free (0.0 if none ran)."""
        ran = self.blocks - self.skipped
        return self.bias_free / ran if ran else 0.0
