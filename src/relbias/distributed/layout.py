"""How a sequence is sharded along its length over P ranks, and the global positions of each shard.

Two layouts (docs/conventions.md for positions; every position here is an absolute token index):

* ``"contiguous"``: the sequence of L tokens is cut into P chunks of L/P; rank r holds chunk r, positions
  ``[r·L/P, (r+1)·L/P)``. Ring Attention's layout (Liu et al. 2023).
* ``"zigzag"``: the sequence is cut into 2P chunks of L/(2P); rank r holds chunks r and 2P-1-r, in that
  order, so under a causal mask every rank does the same work: the load balancing of Brandon et al. 2023,
  "Striped Attention" (which stripes single tokens over ranks), in the chunked form of ring-flash-attention
  and Megatron-LM context parallelism::

      P = 2, L = 8:   chunks  [0 1] [2 3] [4 5] [6 7]
                      rank 0: [0 1]             [6 7]   -> positions 0 1 6 7
                      rank 1:       [2 3] [4 5]         -> positions 2 3 4 5

A shard is described by its *pieces*: ``(start, length)`` of each run of consecutive positions, in local
order. Positions travel with the tensors that hold them (design.md): the ring sends a block's piece starts
with its keys, and single-device attention receives them as ``key_start`` / ``query_start``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._int_args import check_int

__all__ = ["LAYOUTS", "check_layout", "check_seq_len", "shard", "shard_pieces", "shard_positions", "unshard"]

#: The sequence layouts context-parallel attention knows.
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    """Return ``layout`` if it is one of :data:`LAYOUTS`.

    Raises:
        ValueError: any other value, naming it and the known layouts.
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def num_chunks(world_size: int, layout: str) -> int:
    """Equal chunks the layout cuts a sequence into: P (contiguous) or 2P (zigzag)."""
    return world_size if layout == "contiguous" else 2 * world_size


def check_seq_len(seq_len: int, world_size: int, layout: str) -> int:
    """Return the chunk length (tokens) of a ``seq_len``-token sequence on ``world_size`` ranks.

    Raises:
        TypeError: non-int arguments.
        ValueError: ``seq_len`` < 1, ``world_size`` < 1, an unknown layout, or a length not divisible by
            the layout's chunk count (P contiguous, 2P zigzag); the message names the values and the next
            length that would fit.
    """
    check_int("seq_len", seq_len, minimum=1)
    check_int("world_size", world_size, minimum=1)
    check_layout(layout)
    chunks = num_chunks(world_size, layout)
    if seq_len % chunks:
        how = f"{world_size} ranks" if layout == "contiguous" else f"{world_size} ranks x 2 chunks"
        fit = -(-seq_len // chunks) * chunks
        raise ValueError(
            f"layout {layout!r} cuts the sequence into {chunks} equal chunks ({how}), but its length {seq_len} "
            f"is not divisible by {chunks}; pad it to {fit} tokens and mask the padding with a key padding mask"
        )
    return seq_len // chunks


def shard_pieces(seq_len: int, world_size: int, rank: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """The runs of consecutive positions that ``rank`` holds: ``[(start, length), ...]`` in local order.

    Args:
        seq_len: global sequence length L (tokens).
        world_size: number of ranks P.
        rank: the rank r, 0 <= r < P (its rank in the process group that shards the sequence).
        layout: "contiguous" (one piece ``(r·L/P, L/P)``) or "zigzag" (two pieces, chunks r and 2P-1-r).

    Raises:
        TypeError, ValueError: as ``check_seq_len`` (the length must split evenly); a rank outside ``[0, world_size)``.
    """
    chunk = check_seq_len(seq_len, world_size, layout)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if layout == "contiguous":
        return [(rank * chunk, chunk)]
    return [(rank * chunk, chunk), ((2 * world_size - 1 - rank) * chunk, chunk)]


def shard_positions(
    seq_len: int, world_size: int, rank: int, layout: str = "contiguous", device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of the tokens ``rank`` holds: int64 tensor (L/P,), in local order.

    Arguments and errors as :func:`shard_pieces`; ``device`` of the result (default CPU).

    Example:
        >>> shard_positions(8, 2, 0, "zigzag").tolist()
        [0, 1, 6, 7]
    """
    pieces = shard_pieces(seq_len, world_size, rank, layout)
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in pieces])


def shard(tensor: torch.Tensor, world_size: int, rank: int, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of a full tensor sharded along its sequence dimension.

    Args:
        tensor: the full tensor, sequence along ``dim`` (length L), any dtype and device: (B, H, L, D)
            queries, keys, values or outputs with ``dim=-2`` (default); a (B, 1, 1, L) key padding mask with
            ``dim=-1``.
        world_size: number of ranks P.
        rank: the rank r.
        layout: "contiguous" (default) or "zigzag" (see the module docstring).
        dim: the sequence dimension; default -2.

    Returns:
        A new tensor, ``tensor`` with length L/P along ``dim`` (the positions of :func:`shard_positions`).

    Raises:
        TypeError, ValueError: as :func:`shard_pieces` (L not divisible by P, or by 2P for zigzag).
    """
    pieces = shard_pieces(tensor.shape[dim], world_size, rank, layout)
    return torch.cat([tensor.narrow(dim, s, n) for s, n in pieces], dim=dim)


def unshard(shards: Sequence[torch.Tensor], *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of :func:`shard`).

    Args:
        shards: P tensors, rank order, each with length L/P along ``dim`` and equal other sizes
            (e.g. gathered with ``torch.distributed.all_gather``).
        layout: the layout they were sharded with, "contiguous" (default) or "zigzag".
        dim: the sequence dimension; default -2 ((B, H, L/P, D) shards).

    Returns:
        The full tensor, length L = P·(L/P) along ``dim``, positions in ascending order.

    Raises:
        ValueError: no shards, shards of different shapes, an unknown layout, or an odd shard length
            with "zigzag".
    """
    check_layout(layout)
    if len(shards) == 0:
        raise ValueError("unshard needs at least one shard")
    shapes = {tuple(t.shape) for t in shards}
    if len(shapes) != 1:
        raise ValueError(f"every shard must have the same shape, got {sorted(shapes)}")
    world_size, local = len(shards), shards[0].shape[dim]
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    if local % 2:
        raise ValueError(f"a zigzag shard holds 2 equal chunks, so its length must be even; got {local}")
    chunk = local // 2
    ordered: list[torch.Tensor | None] = [None] * (2 * world_size)
    for r, t in enumerate(shards):
        ordered[r] = t.narrow(dim, 0, chunk)
        ordered[2 * world_size - 1 - r] = t.narrow(dim, chunk, chunk)
    return torch.cat(ordered, dim=dim)


def layout_order(seq_len: int, world_size: int, layout: str, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the rank-ordered concatenation of every shard: int64 (L,).

    ``full.index_select(dim, layout_order(...))`` is ``cat([shard(full, P, r) for r in range(P)])``.
    """
    return torch.cat([shard_positions(seq_len, world_size, r, layout, device) for r in range(world_size)])
