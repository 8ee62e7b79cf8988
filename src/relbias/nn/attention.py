"""``MultiheadAttention``: projections around :func:`relbias.attention`, with a KV cache."""

from __future__ import annotations

import torch
from torch import nn

from ..backends import BACKENDS
from ..biases.base import CONVENTIONS, RelativeBias
from ..functional import attention
from .cache import KVCache, StaticKVCache

__all__ = ["MultiheadAttention"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class MultiheadAttention(nn.Module):
    """Multi-head attention with a relative position bias and incremental decoding.

    ``out = out_proj(attention(q_proj(x), k_proj(kv), v_proj(kv), bias=position_bias, ...))`` where
    ``kv`` is ``x`` (self-attention) or ``memory`` (cross-attention), split into ``num_heads`` heads of
    ``head_dim = embed_dim // num_heads``. Scores follow the score convention of
    :func:`relbias.attention` (default: the bias module's own, e.g. unscaled "t5" for T5Bias).

    Positions are absolute tokens. Self-attention queries and keys start at ``cache_position``
    (default 0, or the cache's length when a cache is given); the bias sees offsets ``i - j`` of these
    positions, so decoding token by token with a cache gives the same output as the full forward.

    Args:
        embed_dim: E, the model width.
        num_heads: H; must divide ``embed_dim``.
        position_bias: a :class:`relbias.RelativeBias` (H or 1 heads) or None (no position bias, NoPE).
            The same module may be passed to several layers: it is computed per layer from shared
            parameters (T5 shares one bias table across all layers of a stack).
        is_causal: hide future keys (self-attention only).
        cross_attention: attend from ``query`` to a ``memory`` sequence instead of to itself. A
            cross-attention layer carries a position bias only when ``position_bias`` is given
            explicitly; memory positions start at 0.
        kdim: feature size of ``memory`` for cross-attention; default ``embed_dim``.
        proj_bias: add a learnable bias in the four linear projections (default True; T5 uses False).
        backend: "auto" (default; :func:`relbias.dispatch.choose_backend` picks per call) or a key of
            ``relbias.backends.BACKENDS`` ("reference", "blockwise", ...).
        convention: score convention ("seed", "additive", "t5"); default the bias module's own.
        scale: score scale; default that of the convention (``1/sqrt(head_dim)``, or 1 for "t5").

    Raises:
        ValueError: sizes < 1, ``embed_dim`` not divisible by ``num_heads``, an unknown backend or
            convention, ``is_causal`` with cross-attention, a bias with heads neither 1 nor H.
        TypeError: a ``position_bias`` that is not a RelativeBias.

    Example:
        >>> bias = relbias.T5Bias(num_heads=4, bidirectional=False)
        >>> layer = MultiheadAttention(64, 4, position_bias=bias, is_causal=True)
        >>> x = torch.randn(2, 10, 64)                   # (batch, seq_len, embed_dim)
        >>> full = layer(x)
        >>> cache = KVCache()
        >>> steps = [layer(x[:, t : t + 1], cache=cache) for t in range(10)]
        >>> torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        True
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        position_bias: RelativeBias | None = None,
        is_causal: bool = False,
        cross_attention: bool = False,
        kdim: int | None = None,
        proj_bias: bool = True,
        backend: str = "auto",
        convention: str | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        _positive_int("embed_dim", embed_dim)
        _positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        kdim = embed_dim if kdim is None else _positive_int("kdim", kdim)
        if position_bias is not None and not isinstance(position_bias, RelativeBias):
            raise TypeError(f"position_bias must be a relbias RelativeBias or None, got {type(position_bias).__name__}")
        if position_bias is not None and position_bias.num_heads not in (1, num_heads):
            raise ValueError(
                f"position_bias has num_heads={position_bias.num_heads}; expected 1 (shared) or {num_heads}"
            )
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available: {['auto', *sorted(BACKENDS)]}")
        if convention is not None and convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS} or None, got {convention!r}")
        if cross_attention and is_causal:
            raise ValueError("is_causal applies to self-attention; a cross-attention layer sees the whole memory")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.position_bias = position_bias
        self.is_causal, self.cross_attention = is_causal, cross_attention
        self.backend, self.convention, self.scale = backend, convention, scale
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias)
        self.k_proj = nn.Linear(kdim, embed_dim, bias=proj_bias)
        self.v_proj = nn.Linear(kdim, embed_dim, bias=proj_bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)

    def forward(
        self,
        query: torch.Tensor,
        memory: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        cache: KVCache | StaticKVCache | None = None,
        cache_position: int | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` to itself (self-attention) or to ``memory`` (cross-attention).

        Args:
            query: (B, Lq, E) float.
            memory: cross-attention only: (B, Lm, kdim), same dtype. With a cache that already holds
                the memory's keys and values it may be None (they are reused).
            key_padding_mask: bool (B, Lk), **True marks a padding key to ignore** (as in
                ``torch.nn.MultiheadAttention``). Lk counts every key attended to: cached plus new for
                self-attention with a cache, Lm for cross-attention.
            cache: self-attention: a :class:`KVCache` or :class:`StaticKVCache`; the new keys and values
                are written at ``cache_position`` and the queries attend to positions
                ``0 .. cache_position + Lq - 1``. Cross-attention: a KVCache filled from ``memory`` on
                first use and reused afterwards.
            cache_position: absolute position (tokens) of the first query; default the cache's length
                (append), or 0 without a cache. Must lie in ``[0, cache.length]``.

        Returns:
            (B, Lq, E) in the dtype of ``query``.

        Raises:
            TypeError: a non-tensor input; a query or memory that is not floating point, or (outside
                ``torch.autocast``) whose dtype differs from the layer's parameters; a key padding mask
                that is not bool.
            ValueError: wrong ranks or feature sizes; a query or memory on another device than the
                layer's parameters; memory given to a self-attention layer or missing
                for cross-attention; a key padding mask whose shape is not (B, Lk); a bad cache position;
                and every error of :func:`relbias.attention` (e.g. offsets a per-offset bias cannot
                evaluate with clipping off).
        """
        if not isinstance(query, torch.Tensor):
            raise TypeError(f"query must be a tensor (batch, seq_len, embed_dim={self.embed_dim}), got {type(query).__name__}")
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (batch, seq_len, embed_dim={self.embed_dim}), got {tuple(query.shape)}")
        self._check_like_parameters("query", query)
        start = 0 if cache_position is None and cache is None else cache_position
        if start is None:
            start = cache.length
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"cache_position must be an int >= 0 (tokens), got {cache_position!r}")
        q = self._heads(self.q_proj(query))
        if self.cross_attention:
            key, value = self._memory_kv(memory, cache)
        else:
            if memory is not None:
                raise ValueError("memory is for cross-attention; this layer was built with cross_attention=False")
            key, value = self._heads(self.k_proj(query)), self._heads(self.v_proj(query))
            if cache is not None:
                key, value = cache.update(key, value, start)
            elif start != 0:
                raise ValueError("cache_position without a cache: pass cache= to decode incrementally")
        mask = self._padding_mask(key_padding_mask, q.shape[0], key.shape[2], q.device)
        out = attention(
            q, key, value,
            bias=self.position_bias, mask=mask, is_causal=self.is_causal, scale=self.scale,
            convention=self.convention, query_start=start, key_start=0, backend=self.backend,
        )  # (B, H, Lq, D)
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))  # (B, H, Lq, D) -> (B, Lq, E)

    def _memory_kv(self, memory: torch.Tensor | None, cache: KVCache | StaticKVCache | None):
        if cache is not None and cache.length > 0:
            return (cache.key[:, :, : cache.length], cache.value[:, :, : cache.length])
        if memory is None:
            raise ValueError("cross-attention needs memory (B, Lm, kdim), or a cache already filled from it")
        if not isinstance(memory, torch.Tensor):
            raise TypeError(f"memory must be a tensor (batch, memory_len, kdim), got {type(memory).__name__}")
        if memory.dim() != 3 or memory.shape[-1] != self.k_proj.in_features:
            raise ValueError(f"memory must be (batch, memory_len, kdim={self.k_proj.in_features}), got {tuple(memory.shape)}")
        self._check_like_parameters("memory", memory)
        key, value = self._heads(self.k_proj(memory)), self._heads(self.v_proj(memory))
        if cache is not None:
            cache.update(key, value, 0)
        return key, value

    def _check_like_parameters(self, name: str, x: torch.Tensor) -> None:
        """``x`` must be floating point, on the parameters' device and (outside autocast) of their dtype."""
        weight = self.q_proj.weight
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.device != weight.device:
            raise ValueError(f"{name} is on {x.device} but the layer's parameters are on {weight.device}; move one of them")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name} is {x.dtype} but the layer's parameters are {weight.dtype}; convert one of them "
                f"(e.g. layer.to({x.dtype})) or run under torch.autocast"
            )

    @staticmethod
    def _padding_mask(kpm: torch.Tensor | None, batch: int, key_len: int, device: torch.device) -> torch.Tensor | None:
        """(B, Lk) True = padding -> (B, 1, 1, Lk) True = may attend, as relbias.attention takes masks."""
        if kpm is None:
            return None
        if not isinstance(kpm, torch.Tensor) or kpm.dtype != torch.bool:
            kind = kpm.dtype if isinstance(kpm, torch.Tensor) else type(kpm).__name__
            raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {kind}")
        if tuple(kpm.shape) != (batch, key_len):
            raise ValueError(
                f"key_padding_mask must be (batch, key_len) = {(batch, key_len)} (cached plus new keys), "
                f"got {tuple(kpm.shape)}"
            )
        if kpm.device != device:
            raise ValueError(f"key_padding_mask is on {kpm.device} but query is on {device}")
        return ~kpm[:, None, None, :]

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, is_causal={self.is_causal}, "
            f"cross_attention={self.cross_attention}, backend={self.backend!r}"
        )
