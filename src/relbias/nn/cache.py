"""Key/value caches for incremental decoding: a growing one and a pre-allocated one.

Both keep the keys and values of one attention layer, in the (B, H, L, D) layout, and track
``query_position``: the absolute position (token index in the target sequence) of the next query, i.e.
how many target tokens the layer has decoded with this cache.

* Self-attention: :meth:`update` writes a block of new keys at an explicit ``position`` in
  ``[0, length]`` (``position < length`` rewinds: the entries from ``position`` on are replaced) and
  returns every key and value from position 0 to the end of the new block; ``query_position`` is then
  the end of that block (keys and queries are the same tokens).
* Cross-attention: :meth:`set_memory` stores the memory's keys and values once (positions
  ``0 .. Lm - 1`` of the memory); :meth:`advance` moves ``query_position`` past each block of target
  queries. The queries' positions never depend on the memory's length.

A cache serves one kind: :meth:`update` on a memory cache, or :meth:`set_memory` on a cache filled
by :meth:`update`, raises ``ValueError``.

Windowed layers (``MultiheadAttention(window=(left, right))``, :mod:`relbias.window`) call :meth:`update_window`
instead of :meth:`update`, telling the cache their ``left``: a query at position ``i`` never reads a key before
``i - left``, so after each block the cache needs only the last ``left`` keys. :class:`KVCache` then drops the older
ones (it holds at most ``left`` keys between calls) and :class:`StaticKVCache` becomes a rolling buffer (position
``p`` in slot ``p % capacity``, as Mistral's rolling KV cache), so generation memory is O(W) at any length. Every key
keeps its absolute position: ``key_start`` is the position of the first key a cache still holds, and
:meth:`update_window` returns the keys as :class:`KeyBlock` runs of consecutive positions, each with its own start,
which is what ``relbias.attention(..., key_start=)`` reads the bias offsets from.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["KVCache", "KeyBlock", "StaticKVCache"]


class KeyBlock(NamedTuple):
    """A run of keys and values at consecutive absolute positions ``start .. start + L - 1``.

    Attributes:
        start: absolute position (tokens) of the first key: ``relbias.attention(..., key_start=start)``.
        key: (B, H, L, D).
        value: (B, H, L, Dv).
    """

    start: int
    key: torch.Tensor
    value: torch.Tensor


def _check_left(left: object) -> int | None:
    if left is None:
        return None
    if isinstance(left, bool) or not isinstance(left, int):
        raise TypeError(f"left must be None (every past key) or an int >= 0 (past keys a query sees), got {left!r}")
    if left < 0:
        raise ValueError(f"left must be None (every past key) or an int >= 0 (past keys a query sees), got {left}")
    return left


def _first_needed(position: int, left: int | None, key_start: int, length: int) -> int:
    """The first key position the queries of a block at ``position`` may see (``position - left``, at least 0);
    a ValueError when the cache no longer holds it (dropped or overwritten by a window)."""
    first = 0 if left is None else max(0, position - left)
    if first < key_start:
        reach = "every key from position 0" if left is None else f"the keys from position {first} (left={left})"
        raise ValueError(
            f"the queries at position {position} need {reach}, but this cache holds positions {key_start} .. "
            f"{length - 1} only: a window dropped the older ones. A windowed cache can go back (cache_position) "
            f"only as far as the keys it holds reach; a StaticKVCache with spare capacity holds more of them"
        )
    return first


def _check_position(position: object, length: int) -> int:
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(f"cache position must be an int (tokens), got {position!r}")
    if not 0 <= position <= length:
        raise ValueError(
            f"cache position {position} is outside [0, {length}]: the cache holds positions 0 .. {length - 1}, "
            f"so new keys can start at most at {length} (a larger position would leave a gap)"
        )
    return position


def _check_block(key: torch.Tensor, value: torch.Tensor) -> None:
    if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
        raise TypeError("key and value must be tensors")
    if key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"key and value must be (batch, num_heads, seq_len, head_dim), got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in batch, heads or length")


def _check_query_position(position: object, current: int) -> int:
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(f"query position must be an int (tokens), got {position!r}")
    if not 0 <= position <= current:
        raise ValueError(
            f"query position {position} is outside [0, {current}]: the cache has seen target positions "
            f"0 .. {current - 1}, so the next queries can start at most at {current} (a larger position would "
            f"leave a gap)"
        )
    return position


class _QueryPositionMixin:
    """``query_position``, the cross-attention rules and the one-kind guard shared by both caches."""

    query_position: int
    holds_memory: bool

    def _guard_self(self) -> None:
        if self.holds_memory:
            raise ValueError(
                "this cache holds a cross-attention memory (set_memory); use a separate cache for self-attention"
            )

    def _guard_memory(self) -> None:
        if not self.holds_memory and self.length > 0:
            raise ValueError(
                "this cache holds self-attention keys (update); use a separate cache for cross-attention"
            )

    def advance(self, position: int, num_queries: int) -> None:
        """Record that target queries ``position .. position + num_queries - 1`` were run (cross-attention).

        Args:
            position: absolute position (tokens) of the first query, in ``[0, query_position]``
                (smaller rewinds).
            num_queries: Lq >= 0.

        Raises:
            TypeError: a non-int position or count.
            ValueError: a position outside ``[0, query_position]``; a negative count.
        """
        position = _check_query_position(position, self.query_position)
        if isinstance(num_queries, bool) or not isinstance(num_queries, int) or num_queries < 0:
            raise ValueError(f"num_queries must be an int >= 0, got {num_queries!r}")
        self.query_position = position + num_queries


def _check_device(key: torch.Tensor, value: torch.Tensor, device: torch.device) -> None:
    if key.device != device or value.device != device:
        raise ValueError(
            f"new keys/values are on {key.device}/{value.device} but the cache is on {device}; move the cache "
            f"or the layer"
        )


class KVCache(_QueryPositionMixin):
    """A cache that grows by concatenation: the simplest way to decode token by token.

    Under a windowed layer (:meth:`update_window` with ``left``) it keeps only the last ``left`` keys and values
    after each block, so it never holds more than ``left`` positions between calls: memory O(W) at any length.

    Attributes:
        key: None before the first update, then (B, H, length - key_start, D): the keys of positions
            ``key_start .. length - 1``.
        value: None before the first update, then (B, H, length - key_start, Dv).
        key_start: absolute position (tokens) of the first key held; 0 unless a window dropped older keys.
        query_position: absolute position (tokens) of the next target query; 0 when new.
        holds_memory: True once :meth:`set_memory` filled it (a cross-attention cache).

    Example:
        >>> cache = KVCache()
        >>> k = v = torch.randn(1, 2, 3, 4)
        >>> keys, values = cache.update(k, v, position=0)      # positions 0, 1, 2
        >>> keys, values = cache.update(k[:, :, :1], v[:, :, :1], position=3)
        >>> cache.length
        4
        >>> blocks = cache.update_window(k, v, position=4, left=2)  # a window reads 2 past keys: 2, 3
        >>> [(block.start, block.key.shape[2]) for block in blocks], cache.key_start, cache.key.shape[2]
        ([(2, 5)], 5, 2)
    """

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.key_start = 0
        self._end = 0
        self.query_position = 0
        self.holds_memory = False

    @property
    def length(self) -> int:
        """The position after the last cached one (tokens): the next block starts here by default. Without a window
        it is the number of keys held; a window drops the keys before ``key_start``."""
        return self._end

    def update(self, key: torch.Tensor, value: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values of positions ``position .. position + L - 1`` and return all of ``0 .. position + L - 1``.

        Args:
            key: (B, H, L, D) keys of the new positions.
            value: (B, H, L, Dv) values of the new positions.
            position: absolute position (tokens) of the first new key, in ``[0, length]``; entries
                from ``position`` on are dropped first.

        Returns:
            (keys, values): (B, H, position + L, D) and (B, H, position + L, Dv).

        Raises:
            TypeError: a non-int position or non-tensor key/value.
            ValueError: a position outside ``[0, length]``; key/value of wrong rank, or with batch,
                heads, head_dim, dtype or device different from the cached ones; a cache holding a
                cross-attention memory; a cache whose window dropped keys (``key_start > 0``).
        """
        (block,) = self.update_window(key, value, position, None)
        return block.key, block.value

    def update_window(
        self, key: torch.Tensor, value: torch.Tensor, position: int, left: int | None
    ) -> list[KeyBlock]:
        """Store keys/values of positions ``position .. position + L - 1`` for a layer whose queries see at most
        ``left`` past keys; return the keys those queries may see, and keep only what later queries may.

        The block's queries (positions ``position .. position + L - 1``) see keys from ``position - left`` on
        (0 at least), so the returned block starts there; afterwards the cache keeps the keys of positions
        ``position + L - left .. position + L - 1`` (``key_start`` is the first), at most ``left`` of them.

        Args:
            key: (B, H, L, D) keys of the new positions.
            value: (B, H, L, Dv) values of the new positions.
            position: absolute position (tokens) of the first new key, in ``[0, length]`` (smaller rewinds:
                the entries from ``position`` on are dropped first), with ``position - left >= key_start``.
            left: the layer's window left (past keys a query sees, an int >= 0), or None (every key: as
                :meth:`update`).

        Returns:
            A list of one :class:`KeyBlock`: the keys and values of positions ``max(0, position - left) ..
            position + L - 1`` with that start.

        Raises:
            TypeError, ValueError: as :meth:`update`; a ``left`` that is not None or an int (TypeError) or is
                negative (ValueError); a position whose window reaches keys the cache dropped (a rewind too far
                back, or :meth:`update` after a window dropped keys).
        """
        self._guard_self()
        left = _check_left(left)
        position = _check_position(position, self.length)
        _check_block(key, value)
        first = _first_needed(position, left, self.key_start, self.length)
        end = position + key.shape[2]
        if self.key is None:
            keys, values = key, value
        else:
            old_key = self.key[:, :, first - self.key_start : position - self.key_start]
            old_value = self.value[:, :, first - self.key_start : position - self.key_start]
            if (key.shape[:2] != self.key.shape[:2] or key.shape[3] != self.key.shape[3]
                    or value.shape[3] != self.value.shape[3]):
                raise ValueError(
                    f"new keys {tuple(key.shape)} / values {tuple(value.shape)} do not match the cached "
                    f"{tuple(self.key.shape)} / {tuple(self.value.shape)} in batch, heads or head_dim"
                )
            if key.dtype != old_key.dtype or value.dtype != old_value.dtype:
                raise ValueError(f"new keys are {key.dtype} but the cache holds {old_key.dtype}")
            _check_device(key, value, old_key.device)
            keys = torch.cat([old_key, key], dim=2) if old_key.shape[2] else key
            values = torch.cat([old_value, value], dim=2) if old_value.shape[2] else value
        keep_from = first if left is None else max(first, end - left)
        kept_key, kept_value = keys[:, :, keep_from - first :], values[:, :, keep_from - first :]
        if 2 * kept_key.shape[2] < keys.shape[2]:  # a long block: keep a copy, not a view that holds all of it
            kept_key, kept_value = kept_key.clone(), kept_value.clone()
        self.key, self.value, self.key_start, self._end = kept_key, kept_value, keep_from, end
        self.query_position = end
        return [KeyBlock(first, keys, values)]

    def set_memory(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a cross-attention memory's keys and values (memory positions ``0 .. Lm - 1``).

        ``query_position`` is left as it is: it counts target tokens, not memory tokens. A memory is never
        trimmed, whatever the layer's window.

        Args:
            key: (B, H, Lm, D).
            value: (B, H, Lm, Dv).

        Raises:
            TypeError: non-tensor key/value.
            ValueError: wrong ranks or mismatched key/value; a cache already holding self-attention keys.
        """
        self._guard_memory()
        _check_block(key, value)
        self.key, self.value, self.holds_memory = key, value, True
        self.key_start, self._end = 0, key.shape[2]


class StaticKVCache(_QueryPositionMixin):
    """A pre-allocated cache of fixed capacity, filled in place up to an explicit cache position.

    The buffers never change size, which suits compiled code and servers with a known longest
    sequence. Position ``p`` lives in slot ``p % capacity``. Without a window (:meth:`update`) the slots fill up
    once: only positions ``0 .. length - 1`` are valid, ``length <= capacity``, and :meth:`update` returns views of
    them. Under a windowed layer (:meth:`update_window` with ``left <= capacity``) the buffers are a rolling buffer
    (Mistral's rolling KV cache): a new position overwrites the one ``capacity`` tokens before it, the cache holds
    positions ``key_start .. length - 1`` (the last ``capacity`` at most) and decoding goes on past the capacity.
    A capacity of ``left + 1`` (the W keys of a causal window ``(W - 1, 0)``) lets every single-token step attend
    from the buffers alone; spare capacity lets a step go back (``cache_position``) as far as the keys held reach.

    Args:
        batch: B.
        num_heads: H.
        capacity: largest number of positions (tokens) the cache can hold, >= 1.
        head_dim: D of the keys.
        value_dim: Dv of the values; default ``head_dim``.
        dtype: dtype of the buffers; default float32.
        device: device of the buffers; default CPU.

    Attributes:
        key: (B, H, capacity, D) zeros until written.
        value: (B, H, capacity, Dv).
        length: the position after the last written one (end of the last written block, or the memory's length).
        key_start: absolute position (tokens) of the first position still held; 0 until a rolling buffer wraps.
        query_position: absolute position (tokens) of the next target query; 0 when new.
        holds_memory: True once :meth:`set_memory` filled it (a cross-attention cache).

    Raises:
        ValueError: a size < 1.
    """

    def __init__(
        self,
        batch: int,
        num_heads: int,
        capacity: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        for name, size in (("batch", batch), ("num_heads", num_heads), ("capacity", capacity),
                           ("head_dim", head_dim), ("value_dim", value_dim)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an int >= 1, got {size!r}")
        self.key = torch.zeros(batch, num_heads, capacity, head_dim, dtype=dtype, device=device)
        self.value = torch.zeros(batch, num_heads, capacity, value_dim, dtype=dtype, device=device)
        self.length = 0
        self.key_start = 0
        self.query_position = 0
        self.holds_memory = False

    @property
    def capacity(self) -> int:
        """Largest number of positions (tokens) the cache can hold."""
        return self.key.shape[2]

    def update(self, key: torch.Tensor, value: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions ``position .. position + L - 1`` in place; return views of ``0 .. position + L - 1``.

        Args:
            key: (B, H, L, D), same B, H, D, dtype and device as the buffers.
            value: (B, H, L, Dv).
            position: absolute position (tokens) of the first new key, in ``[0, length]``.

        Returns:
            (keys, values): views (B, H, position + L, D) and (B, H, position + L, Dv) of the buffers.

        Raises:
            TypeError: a non-int position.
            ValueError: a position outside ``[0, length]``; ``position + L > capacity``; shapes,
                dtypes or a device that differ from the buffers'; a cache holding a cross-attention memory; a
                rolling buffer that has wrapped (``key_start > 0``).
        """
        (block,) = self.update_window(key, value, position, None)
        return block.key, block.value

    def update_window(
        self, key: torch.Tensor, value: torch.Tensor, position: int, left: int | None
    ) -> list[KeyBlock]:
        """Write positions ``position .. position + L - 1`` for a layer whose queries see at most ``left`` past
        keys (a rolling buffer once ``length`` passes the capacity); return the keys those queries may see.

        Args:
            key: (B, H, L, D), same B, H, D, dtype and device as the buffers.
            value: (B, H, L, Dv).
            position: absolute position (tokens) of the first new key, in ``[0, length]`` (smaller rewinds), with
                ``position - left >= key_start``.
            left: the layer's window left (past keys a query sees, an int >= 0, at most ``capacity`` once the
                positions pass the capacity), or None (every key: as :meth:`update`).

        Returns:
            The keys and values of positions ``max(0, position - left) .. position + L - 1`` in position order, as
            one or two :class:`KeyBlock` runs: views of the buffers, two when that range wraps around the end of
            the buffers (their softmaxes merge by log-sum-exp, as ``MultiheadAttention`` does); or, for a block
            that does not fit in the buffers together with the past keys it reads (a long prefill chunk), one new
            tensor (the past keys copied before the buffers are overwritten).

        Raises:
            TypeError, ValueError: as :meth:`update`; a ``left`` that is not None or an int (TypeError) or is
                negative (ValueError); a ``left`` larger than the capacity once the positions pass it (the buffers
                cannot hold the keys later queries read); a position whose window reaches keys already overwritten.
        """
        self._guard_self()
        left = _check_left(left)
        position = _check_position(position, self.length)
        self._check_like_buffers(key, value)
        first = _first_needed(position, left, self.key_start, self.length)
        capacity, count = self.capacity, key.shape[2]
        end = position + count
        if end > capacity and (left is None or left > capacity):
            if left is None:
                raise ValueError(
                    f"the block of {count} tokens at position {position} ends at {end}, beyond the cache capacity "
                    f"{capacity}; allocate a larger StaticKVCache"
                )
            raise ValueError(
                f"the block of {count} tokens at position {position} ends at {end}, beyond the cache capacity "
                f"{capacity}, and the layer's window reads {left} past keys: a rolling buffer must hold them; "
                f"allocate a StaticKVCache of capacity >= {left + 1} (the window's keys, the current one included)"
            )
        if end - first <= capacity:  # the block and the past keys it reads fit: write, then read views in place
            self._write(key, value, position)
            blocks = self._views(first, end)
        else:  # a long chunk: copy the past keys it reads before the buffers are overwritten, one run
            past = self._views(first, position)
            blocks = [KeyBlock(first, torch.cat([b.key for b in past] + [key], dim=2),
                               torch.cat([b.value for b in past] + [value], dim=2))]
            kept = min(count, capacity)
            self._write(key[:, :, count - kept :], value[:, :, count - kept :], end - kept)
        self.length, self.key_start = end, max(self.key_start, end - capacity)
        self.query_position = end
        return blocks

    def set_memory(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a cross-attention memory's keys and values at buffer positions ``0 .. Lm - 1``.

        ``query_position`` is left as it is: it counts target tokens, not memory tokens, and is not
        bounded by the capacity. A memory is never rolled, whatever the layer's window.

        Args:
            key: (B, H, Lm, D), same B, H, D, dtype and device as the buffers; ``Lm <= capacity``.
            value: (B, H, Lm, Dv).

        Raises:
            TypeError: non-tensor key/value.
            ValueError: ``Lm > capacity``; shapes, dtypes or a device that differ from the buffers'; a
                cache already holding self-attention keys.
        """
        self._guard_memory()
        self._check_like_buffers(key, value)
        end = key.shape[2]
        if end > self.capacity:
            raise ValueError(
                f"the block of {end} tokens at position 0 ends at {end}, beyond the cache capacity {self.capacity}; "
                f"allocate a larger StaticKVCache"
            )
        self._write(key, value, 0)
        self.length, self.holds_memory = end, True

    def _check_like_buffers(self, key: torch.Tensor, value: torch.Tensor) -> None:
        _check_block(key, value)
        b, h, _, d = self.key.shape
        if (key.shape[0], key.shape[1], key.shape[3], value.shape[3]) != (b, h, d, self.value.shape[3]):
            raise ValueError(
                f"new keys {tuple(key.shape)} / values {tuple(value.shape)} do not match the cache buffers "
                f"{tuple(self.key.shape)} / {tuple(self.value.shape)} in batch, heads or head_dim"
            )
        if key.dtype != self.key.dtype or value.dtype != self.value.dtype:
            raise ValueError(f"new keys are {key.dtype} but the cache holds {self.key.dtype}")
        _check_device(key, value, self.key.device)

    def _write(self, key: torch.Tensor, value: torch.Tensor, position: int) -> None:
        """Write ``L <= capacity`` positions from ``position`` on into their slots (two pieces when they wrap)."""
        capacity, count = self.capacity, key.shape[2]
        slot = position % capacity
        head = min(count, capacity - slot)
        self.key[:, :, slot : slot + head] = key[:, :, :head]
        self.value[:, :, slot : slot + head] = value[:, :, :head]
        if head < count:
            self.key[:, :, : count - head] = key[:, :, head:]
            self.value[:, :, : count - head] = value[:, :, head:]

    def _views(self, begin: int, end: int) -> list[KeyBlock]:
        """Positions ``begin .. end - 1`` (at most ``capacity``, all held) as views of the buffers in position order:
        one run, or two when the range wraps around the end of the buffers (eager code: no copy; the caller merges
        the runs by log-sum-exp). While torch.compile traces, one run gathered in position order instead: a copy
        of the window, but no Python branch on where it wraps or on the length of each piece, each of which would
        be a guard and a graph of its own (about twice as many graphs in a decoding loop)."""
        capacity = self.capacity
        if torch.compiler.is_compiling():
            index = (torch.arange(end - begin, device=self.key.device) + begin) % capacity
            return [KeyBlock(begin, self.key.index_select(2, index), self.value.index_select(2, index))]
        slot = begin % capacity
        head = min(end - begin, capacity - slot)
        blocks = [KeyBlock(begin, self.key[:, :, slot : slot + head], self.value[:, :, slot : slot + head])]
        if head < end - begin:
            rest = end - begin - head
            blocks.append(KeyBlock(begin + head, self.key[:, :, :rest], self.value[:, :, :rest]))
        return blocks
