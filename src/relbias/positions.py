"""Relative offsets between queries and keys: the one place where the sign convention lives.

Convention (``docs/conventions.md``): ``offset = i - j`` = query position minus key position, in
tokens. Past keys have a positive offset, the diagonal is 0, future keys are negative. Hugging Face
and Mesh TensorFlow call ``key_pos - query_pos`` the "relative position": it is ``-offset``.

Alignment when ``query_len != key_len``: the first key sits at ``key_start`` (default 0) and the
first query at ``query_start``; when ``query_start`` is not given, queries are aligned to the last
keys (query ``t`` sits at ``key_start + key_len - query_len + t``), as decoding with a KV cache needs.

Positions may also arrive as 0-dim integer tensors (a static KV cache counts its tokens in one, so that a
compiled decoding step serves every step). Eager code reads such a tensor once (``int(...)``, one O(1) read) and
works on ints; under ``torch.compile`` it stays a tensor, so the graph does not depend on its value: the
alignment's positions and offsets are then 0-dim tensors and its offset tensors are built by tensor arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._int_args import check_int

Position = int | torch.Tensor  # an int, or (under torch.compile only) a 0-dim integer tensor

__all__ = ["Alignment", "resolve_alignment", "relative_offsets"]


_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, init=False)
class Alignment:
    """Absolute positions of a block of queries against a block of keys.

    Every field is in tokens.

    Attributes:
        query_len: number of queries Lq (>= 0).
        key_len: number of keys Lk (>= 0).
        query_start: absolute position of the first query: an int, or under ``torch.compile`` a 0-dim integer
            tensor (:func:`resolve_alignment`); then ``min_offset`` and ``max_offset`` are 0-dim tensors too.
        key_start: absolute position of the first key, the same.
        min_offset: smallest offset ``i - j`` in the block, ``query_start - (key_start + key_len - 1)``.
        max_offset: largest offset, ``query_start + query_len - 1 - key_start`` (derived, like the next).
        num_offsets: ``max_offset - min_offset + 1 = query_len + key_len - 1`` distinct offsets (0 if
            either length is 0).
    """

    query_len: int
    key_len: int
    query_start: Position
    key_start: Position

    def __init__(self, query_len: int, key_len: int, query_start: Position, key_start: Position):
        # one dict update instead of a frozen dataclass's object.__setattr__ per field (built on every call)
        self.__dict__.update(query_len=query_len, key_len=key_len, query_start=query_start, key_start=key_start)

    @property
    def min_offset(self) -> Position:
        return self.query_start - (self.key_start + self.key_len - 1)

    @property
    def max_offset(self) -> Position:
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
        return torch.arange(self.num_offsets, device=device) + _on(self.min_offset, device)

    def offsets(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Offset matrix ``(query_start + t) - (key_start + s)``: int64 tensor (query_len, key_len)."""
        q = torch.arange(self.query_len, device=device) + _on(self.query_start, device)
        k = torch.arange(self.key_len, device=device) + _on(self.key_start, device)
        return q[:, None] - k[None, :]


def _on(position: Position, device: torch.device | str | None) -> Position:
    """An int as it is; a 0-dim position tensor as int64 on ``device`` (added to an int64 arange there)."""
    return position.to(device=device, dtype=torch.int64) if isinstance(position, torch.Tensor) else position


def _position(name: str, value: object) -> Position:
    """An int position as it is; a 0-dim integer tensor read as an int, or kept as a tensor under torch.compile.

    Raises:
        TypeError: neither an int (bools rejected) nor a 0-dim integer (non-bool) tensor.
    """
    if not isinstance(value, torch.Tensor):
        return check_int(name, value)
    if value.dim() != 0 or value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(
            f"{name} must be an int or a 0-dim integer tensor, got a tensor of shape {tuple(value.shape)} and "
            f"dtype {value.dtype}"
        )
    if torch.compiler.is_compiling():
        return value  # its value is data: reading it would specialise (or break) the graph
    return int(value)


def resolve_alignment(
    query_len: int, key_len: int, *, query_start: Position | None = None, key_start: Position = 0
) -> Alignment:
    """Fill in the default alignment and validate lengths and positions.

    Args:
        query_len: number of queries Lq, tokens, >= 0.
        key_len: number of keys Lk, tokens, >= 0.
        query_start: absolute position of the first query, an int or a 0-dim integer tensor (e.g. a static KV
            cache's token count); default ``key_start + key_len - query_len`` (queries aligned to the last keys,
            as with a KV cache).
        key_start: absolute position of the first key, the same; default 0.

    Returns:
        An :class:`Alignment`. A tensor position is read as an int in eager mode; under ``torch.compile`` it stays
        a 0-dim tensor, and the int64 range check below (a read of its value) is skipped.

    Raises:
        TypeError: a length is not an int, or a position neither an int nor a 0-dim integer tensor (bools and
            bool tensors are rejected).
        ValueError: a length is negative; positions or offsets beyond int64.
    """
    check_int("query_len", query_len, minimum=0)
    check_int("key_len", key_len, minimum=0)
    if type(key_start) is not int:  # plain ints, the common case, need no conversion
        key_start = _position("key_start", key_start)
    if query_start is None:
        query_start = key_start + key_len - query_len
    elif type(query_start) is not int:
        query_start = _position("query_start", query_start)
    alignment = Alignment(query_len, key_len, query_start, key_start)
    if isinstance(query_start, torch.Tensor) or isinstance(key_start, torch.Tensor):
        return alignment  # compiling: a tensor's value cannot be checked without reading it
    # every position and offset is at most |query_start| + |key_start| + query_len + key_len in size
    if abs(query_start) + abs(key_start) + query_len + key_len > _INT64_MAX and any(abs(x) > _INT64_MAX for x in (
            query_start, key_start, query_start + query_len, key_start + key_len, alignment.min_offset,
            alignment.max_offset)):
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
    query_start: Position | None = None,
    key_start: Position = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Offsets ``i - j`` (query position minus key position) for every (query, key) pair.

    Args:
        query_len: number of queries Lq, tokens.
        key_len: number of keys Lk, tokens.
        query_start: absolute position of the first query (an int or a 0-dim integer tensor); default aligns
            queries to the last keys.
        key_start: absolute position of the first key (the same); default 0.
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
