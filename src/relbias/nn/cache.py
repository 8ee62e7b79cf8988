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
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "StaticKVCache"]


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

    Attributes:
        key: None before the first update, then (B, H, length, D).
        value: None before the first update, then (B, H, length, Dv).
        query_position: absolute position (tokens) of the next target query; 0 when new.
        holds_memory: True once :meth:`set_memory` filled it (a cross-attention cache).

    Example:
        >>> cache = KVCache()
        >>> k = v = torch.randn(1, 2, 3, 4)
        >>> keys, values = cache.update(k, v, position=0)      # positions 0, 1, 2
        >>> keys, values = cache.update(k[:, :, :1], v[:, :, :1], position=3)
        >>> cache.length
        4
    """

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.query_position = 0
        self.holds_memory = False

    @property
    def length(self) -> int:
        """Number of cached positions (tokens); the next block starts here by default."""
        return 0 if self.key is None else self.key.shape[2]

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
                cross-attention memory.
        """
        self._guard_self()
        position = _check_position(position, self.length)
        _check_block(key, value)
        if self.key is None:
            self.key, self.value = key, value
            self.query_position = key.shape[2]
            return key, value
        old_key, old_value = self.key[:, :, :position], self.value[:, :, :position]
        if key.shape[:2] != old_key.shape[:2] or key.shape[3] != old_key.shape[3] or value.shape[3] != old_value.shape[3]:
            raise ValueError(
                f"new keys {tuple(key.shape)} / values {tuple(value.shape)} do not match the cached "
                f"{tuple(self.key.shape)} / {tuple(self.value.shape)} in batch, heads or head_dim"
            )
        if key.dtype != old_key.dtype or value.dtype != old_value.dtype:
            raise ValueError(f"new keys are {key.dtype} but the cache holds {old_key.dtype}")
        _check_device(key, value, old_key.device)
        self.key = torch.cat([old_key, key], dim=2)
        self.value = torch.cat([old_value, value], dim=2)
        self.query_position = self.key.shape[2]
        return self.key, self.value

    def set_memory(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a cross-attention memory's keys and values (memory positions ``0 .. Lm - 1``).

        ``query_position`` is left as it is: it counts target tokens, not memory tokens.

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


class StaticKVCache(_QueryPositionMixin):
    """A pre-allocated cache of fixed capacity, filled in place up to an explicit cache position.

    The buffers never change size, which suits compiled code and servers with a known longest
    sequence. Only positions ``0 .. length - 1`` are valid; :meth:`update` returns views of them.

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
        length: number of valid positions (end of the last written block, or the memory's length).
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
                dtypes or a device that differ from the buffers'; a cache holding a cross-attention memory.
        """
        self._guard_self()
        position = _check_position(position, self.length)
        end = self._write(key, value, position)
        self.query_position = end
        return self.key[:, :, :end], self.value[:, :, :end]

    def set_memory(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a cross-attention memory's keys and values at buffer positions ``0 .. Lm - 1``.

        ``query_position`` is left as it is: it counts target tokens, not memory tokens, and is not
        bounded by the capacity.

        Args:
            key: (B, H, Lm, D), same B, H, D, dtype and device as the buffers; ``Lm <= capacity``.
            value: (B, H, Lm, Dv).

        Raises:
            TypeError: non-tensor key/value.
            ValueError: ``Lm > capacity``; shapes, dtypes or a device that differ from the buffers'; a
                cache already holding self-attention keys.
        """
        self._guard_memory()
        self.length = self._write(key, value, 0)
        self.holds_memory = True

    def _write(self, key: torch.Tensor, value: torch.Tensor, position: int) -> int:
        _check_block(key, value)
        end = position + key.shape[2]
        if end > self.capacity:
            raise ValueError(
                f"the block of {key.shape[2]} tokens at position {position} ends at {end}, beyond the cache "
                f"capacity {self.capacity}; allocate a larger StaticKVCache"
            )
        b, h, _, d = self.key.shape
        if (key.shape[0], key.shape[1], key.shape[3], value.shape[3]) != (b, h, d, self.value.shape[3]):
            raise ValueError(
                f"new keys {tuple(key.shape)} / values {tuple(value.shape)} do not match the cache buffers "
                f"{tuple(self.key.shape)} / {tuple(self.value.shape)} in batch, heads or head_dim"
            )
        if key.dtype != self.key.dtype or value.dtype != self.value.dtype:
            raise ValueError(f"new keys are {key.dtype} but the cache holds {self.key.dtype}")
        _check_device(key, value, self.key.device)
        self.key[:, :, position:end] = key
        self.value[:, :, position:end] = value
        self.length = end
        return end
