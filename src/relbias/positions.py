"""Relative offsets between queries and keys: the one place where the sign convention lives.

Convention (``docs/conventions.md``): ``offset = i - j`` = query position minus key position, in
tokens. Past keys have a positive offset, the diagonal is 0, future keys are negative. Hugging Face
and Mesh TensorFlow call ``key_pos - query_pos`` the "relative position": it is ``-offset``.

Alignment when ``query_len != key_len``: the first key sits at ``key_start`` (default 0) and the
first query at ``query_start``; when ``query_start`` is not given, queries are aligned to the last
keys (query ``t`` sits at ``key_start + key_len - query_len + t``), as decoding with a KV cache needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._int_args import check_int

__all__ = ["Alignment", "resolve_alignment", "relative_offsets"]


_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Alignment:
    """Absolute positions of a block of queries against a block of keys.

    Attributes (all in tokens):
        query_len: number of queries Lq (>= 0).
        key_len: number of keys Lk (>= 0).
        query_start: absolute position of the first query.
        key_start: absolute position of the first key.

    Derived:
        min_offset: smallest offset ``i - j`` in the block, ``query_start - (key_start + key_len - 1)``.
        max_offset: largest offset, ``query_start + query_len - 1 - key_start``.
        num_offsets: ``max_offset - min_offset + 1 = query_len + key_len - 1`` distinct offsets (0 if
            either length is 0).
    """

    query_len: int
    key_len: int
    query_start: int
    key_start: int

    @property
    def min_offset(self) -> int:
        return self.query_start - (self.key_start + self.key_len - 1)

    @property
    def max_offset(self) -> int:
        return self.query_start + self.query_len - 1 - self.key_start

    @property
    def num_offsets(self) -> int:
        if self.query_len == 0 or self.key_len == 0:
            return 0
        return self.query_len + self.key_len - 1

    def offset_vector(self, device: torch.device | str | None = None) -> torch.Tensor:
        """All offsets of the block in ascending order: int64 tensor of shape (num_offsets,).

        Entry ``n`` is offset ``min_offset + n``; a backend finds the value of pair (t, s) at index
        ``offsets[t, s] - min_offset``.
        """
        return torch.arange(self.min_offset, self.min_offset + self.num_offsets, device=device)

    def offsets(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Offset matrix ``(query_start + t) - (key_start + s)``: int64 tensor (query_len, key_len)."""
        q = torch.arange(self.query_start, self.query_start + self.query_len, device=device)
        k = torch.arange(self.key_start, self.key_start + self.key_len, device=device)
        return q[:, None] - k[None, :]


def resolve_alignment(
    query_len: int, key_len: int, *, query_start: int | None = None, key_start: int = 0
) -> Alignment:
    """Fill in the default alignment and validate lengths and positions.

    Args:
        query_len: number of queries Lq, tokens, >= 0.
        key_len: number of keys Lk, tokens, >= 0.
        query_start: absolute position of the first query; default ``key_start + key_len - query_len``
            (queries aligned to the last keys, as with a KV cache).
        key_start: absolute position of the first key; default 0.

    Returns:
        An :class:`Alignment`.

    Raises:
        TypeError: a length or position is not an int (bools are rejected).
        ValueError: a length is negative; positions or offsets beyond int64.
    """
    check_int("query_len", query_len, minimum=0)
    check_int("key_len", key_len, minimum=0)
    check_int("key_start", key_start)
    if query_start is None:
        query_start = key_start + key_len - query_len
    check_int("query_start", query_start)
    alignment = Alignment(query_len, key_len, query_start, key_start)
    extremes = (query_start, key_start, query_start + query_len, key_start + key_len, alignment.min_offset,
                alignment.max_offset)
    if any(abs(x) > _INT64_MAX for x in extremes):
        raise ValueError(
            f"positions and offsets must fit in int64 (|x| <= 2**63 - 1); query_start={query_start}, "
            f"key_start={key_start} with lengths {query_len}, {key_len} give offsets "
            f"{alignment.min_offset}..{alignment.max_offset}"
        )
    return alignment


def relative_offsets(
    query_len: int,
    key_len: int,
    *,
    query_start: int | None = None,
    key_start: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Offsets ``i - j`` (query position minus key position) for every (query, key) pair.

    Args:
        query_len: number of queries Lq, tokens.
        key_len: number of keys Lk, tokens.
        query_start: absolute position of the first query; default aligns queries to the last keys.
        key_start: absolute position of the first key; default 0.
        device: device of the result.

    Returns:
        int64 tensor of shape (Lq, Lk); entry (t, s) is ``(query_start + t) - (key_start + s)``.
        Hugging Face's ``relative_position`` is the negation of this.

    Raises:
        TypeError, ValueError: as :func:`resolve_alignment`.

    Example:
        >>> relative_offsets(2, 3)      # queries at positions 1, 2; keys at 0, 1, 2
        tensor([[ 1,  0, -1],
                [ 2,  1,  0]])
    """
    return resolve_alignment(
        query_len, key_len, query_start=query_start, key_start=key_start
    ).offsets(device)
