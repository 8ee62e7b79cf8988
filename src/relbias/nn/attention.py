"""``MultiheadAttention``: projections around :func:`relbias.attention`, with a KV cache."""

from __future__ import annotations

import torch
from torch import nn

from .._attention_inputs import check_additive_mask
from ..backends import BACKENDS
from ..biases.base import CONVENTIONS, RelativeBias
from ..functional import attention, attention_with_weights
from ..window import check_window
from .cache import KeyBlock, KVCache, StaticKVCache, _check_query_position
from .torch_layer import from_torch_layer, join_names, translate_torch_state

__all__ = ["MultiheadAttention"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class MultiheadAttention(nn.Module):
    """Multi-head attention with a relative position bias and a KV cache; torch's call signature.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` takes the arguments of
    :class:`torch.nn.MultiheadAttention` with the same meaning (layout set by ``batch_first``, default
    False = (L, B, E) as in torch; unbatched (L, E) inputs; key padding mask True = padding; bool
    ``attn_mask`` True = NOT allowed) and returns ``(output, weights or None)``. Without a position
    bias it computes what torch's module computes with the same weights: :meth:`from_torch` converts a
    trained torch layer, and ``load_state_dict`` also takes torch's state dict (``in_proj_weight`` is split into
    ``q_proj``/``k_proj``/``v_proj``). The relbias extras are keyword
    arguments: ``position_bias``, ``cross_attention``, ``backend``, ``convention``, ``scale``, ``window`` here and
    ``cache``, ``cache_position`` in :meth:`forward`; ``process_group``, ``cp_layout``, ``cp_strategy``
    run it context-parallel on sequence shards (below).

    ``out = out_proj(attention(q_proj(query), k_proj(key), v_proj(value), bias=position_bias, ...))``,
    split into ``num_heads`` heads of ``head_dim = embed_dim // num_heads``. Scores follow the score
    convention of :func:`relbias.attention` (default: the bias module's own, e.g. unscaled "t5" for
    T5Bias; torch's ``1/sqrt(head_dim)`` scaling is "additive" or "seed" with no bias).

    Positions are absolute tokens. Queries start at ``cache_position`` (default 0, or the cache's
    ``query_position`` -- the number of target tokens already decoded with it). Self-attention keys are
    the same tokens as the queries; cross-attention keys are memory positions ``0 .. Lm - 1``, whatever
    the query's position. The bias sees offsets ``i - j`` of these positions, so decoding token by token
    with a cache gives the same output as the full forward, for self- and cross-attention.

    Args:
        embed_dim: E, the model width.
        num_heads: H; must divide ``embed_dim``.
        kdim: feature size of ``key``; default ``embed_dim``.
        vdim: feature size of ``value``; default ``embed_dim``.
        batch_first: True: inputs and outputs are (B, L, E); False (default, as torch): (L, B, E).
            Ignored for unbatched (L, E) inputs.
        device, dtype: of the parameters (as torch's factory kwargs); default torch's defaults.
        position_bias: a :class:`relbias.RelativeBias` (H or 1 heads) or None (no position bias, NoPE).
            The same module may be passed to several layers: it is computed per layer from shared
            parameters (T5 shares one bias table across all layers of a stack).
        is_causal: always hide future keys (self-attention only); ``forward(is_causal=True)`` does it
            per call.
        cross_attention: ``key``/``value`` are a memory sequence at positions ``0 .. Lm - 1`` (a cache
            stores it once) instead of the query's own tokens. A cross-attention layer carries a
            position bias only when ``position_bias`` is given explicitly.
        proj_bias: add a learnable bias in the four linear projections (default True, torch's
            ``bias``; T5 uses False).
        backend: "auto" (default; :func:`relbias.explain_backend` names what it picks) or a key of
            ``relbias.backends.BACKENDS`` ("reference", "blockwise", ...). ``need_weights=True`` always
            runs "reference".
        convention: score convention ("seed", "additive", "t5"); default the bias module's own.
        scale: score scale; default that of the convention (``1/sqrt(head_dim)``, or 1 for "t5").
        window: local (sliding-window) attention: None (default: every key), or a pair ``(left, right)`` of ints
            >= 0 (tokens) or None (unbounded on that side). The query at absolute position ``i`` sees the keys
            ``j`` with ``i - left <= j <= i + right`` (offsets ``-right <= i - j <= left``), in every call the layer
            makes: self-attention (with or without a cache, ``need_weights=True`` and packed ``cu_seqlens`` too)
            and cross-attention, where ``j`` is a memory position ``0 .. Lm - 1`` (unusual there: a monotonic,
            streaming alignment of target position ``i`` to memory position ``i``). It is FlashAttention's
            ``window_size=(left, right)`` with None for its -1 (:mod:`relbias.window`); with ``is_causal=True``,
            ``(W - 1, 0)`` is the sliding window of W keys of Mistral (Jiang et al. 2023) and Longformer. With a
            self-attention cache the layer tells the cache its ``left`` (:meth:`KVCache.update_window`): a
            :class:`KVCache` keeps only the last ``left`` keys and a :class:`StaticKVCache` of capacity >= ``left``
            (``left + 1`` = W recommended) becomes a rolling buffer, so decoding memory is O(W) at any length, and
            token-by-token decoding with either equals the full windowed forward. A cross-attention cache keeps the
            whole memory. Stored as ``self.window``, normalised to a tuple, or None when it bounds nothing.
        process_group: None (default: the layer sees whole sequences), a ``torch.distributed`` process
            group (``torch.distributed.group.WORLD`` for the default one) or a 1-D ``DeviceMesh`` (a named
            dimension of a larger mesh, ``mesh["cp"]``) over which sequences are sharded
            along their length (context parallelism). Then every rank of the group calls the layer with its
            own shard of the query (and, for cross-attention, its shard of the memory, sharded the same way)
            and gets back its output shard; the result is the single-process layer's on the unsharded
            inputs, sharded. Self-attention runs :func:`relbias.distributed.context_parallel_attention`
            (the bias at global positions from ``cp_layout``). Cross-attention projects the local memory
            shard and all-gathers the keys and values (:func:`relbias.distributed.gather_sequence`,
            differentiable), then attends with the local queries at their global positions. Under a group:
            ``need_weights=False`` is required, no ``attn_mask``, ``cache`` or ``cache_position``, and a
            ``key_padding_mask`` must be bool, (B, S/P), this rank's shard of the full padding mask (every
            rank passes one or none does); ``backend`` is not used by self-attention. Gradients: the
            parameters of a self-attention layer's ``position_bias`` come back summed over the group (as
            ``context_parallel_attention`` does; ``cp_sync_bias_grads=False`` leaves them this rank's part);
            every other gradient (projections, a cross-attention layer's bias) is this rank's part, to be
            summed over the group (as data-parallel training does).
        cp_layout: with ``process_group``, how sequences are sharded: "contiguous" (default; rank r holds
            positions ``[r·L/P, (r+1)·L/P)``) or "zigzag" (see :mod:`relbias.distributed.layout`).
        cp_strategy: with ``process_group``, self-attention's strategy: "auto" (default: "halo" for a ``window``
            bounded on both sides, the right by ``is_causal`` too, with ``cp_layout="contiguous"``, else "ring"),
            "ring", "ulysses" or "halo" (:func:`relbias.distributed.context_parallel_attention`; "halo" with
            ``cp_layout="zigzag"`` or without a window's left side is refused here, a ValueError).
        cp_sync_bias_grads: with ``process_group``: True (default) sums the ``position_bias`` gradients over the
            group in backward; False leaves each rank its part, like every other parameter's, for a data-parallel
            wrapper that reduces over the group's ranks too (FSDP2 over a flattened data x context mesh;
            ``sync_bias_grads`` of :func:`relbias.distributed.context_parallel_attention`).

    Not supported (a TypeError for the unexpected keyword, never a silent difference): torch's
    ``dropout``, ``bias`` (here ``proj_bias``), ``add_bias_kv``, ``add_zero_attn`` (:meth:`from_torch` refuses a
    torch layer that uses them, a ValueError).

    Raises:
        ValueError: sizes < 1, ``embed_dim`` not divisible by ``num_heads``, an unknown backend or
            convention, ``is_causal`` with cross-attention, a bias with heads neither 1 nor H, a negative ``window``
            side.
        TypeError: a ``position_bias`` that is not a RelativeBias; a non-bool ``batch_first`` or
            ``cp_sync_bias_grads``; a ``process_group`` that is not a process group, a 1-D DeviceMesh or None
            (a DeviceMesh of more than one dimension: ValueError); a ``window`` that is not None or a pair, or a
            side that is neither an int nor None.

    Example:
        >>> import torch, relbias
        >>> from relbias.nn import KVCache, MultiheadAttention
        >>> bias = relbias.T5Bias(num_heads=4, bidirectional=False)
        >>> layer = MultiheadAttention(64, 4, batch_first=True, position_bias=bias, is_causal=True)
        >>> x = torch.randn(2, 10, 64)                   # (batch, seq_len, embed_dim)
        >>> full, weights = layer(x, x, x)               # weights (2, 10, 10), averaged over heads
        >>> cache = KVCache()
        >>> steps = [layer(x[:, t : t + 1], need_weights=False, cache=cache)[0] for t in range(10)]
        >>> torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        True
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        position_bias: RelativeBias | None = None,
        is_causal: bool = False,
        cross_attention: bool = False,
        proj_bias: bool = True,
        backend: str = "auto",
        convention: str | None = None,
        scale: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        process_group: object = None,
        cp_layout: str = "contiguous",
        cp_strategy: str = "auto",
        cp_sync_bias_grads: bool = True,
    ) -> None:
        super().__init__()
        _positive_int("embed_dim", embed_dim)
        _positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        kdim = embed_dim if kdim is None else _positive_int("kdim", kdim)
        vdim = embed_dim if vdim is None else _positive_int("vdim", vdim)
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got {batch_first!r}")
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
        from ..distributed.groups import resolve_group
        from ..distributed.layout import check_layout
        from ..distributed.validate import STRATEGIES, resolve_strategy

        check_layout(cp_layout)
        if cp_strategy not in STRATEGIES:
            raise ValueError(f"cp_strategy must be one of {STRATEGIES}, got {cp_strategy!r}")
        if not isinstance(cp_sync_bias_grads, bool):
            raise TypeError(f"cp_sync_bias_grads must be a bool, got {cp_sync_bias_grads!r}")
        resolve_group(process_group, argument="process_group")  # the type and shape checks, at construction
        self.window = check_window(window)
        if process_group is not None and cp_strategy == "halo":  # what no call can run (is_causal may come later)
            resolve_strategy(cp_strategy, cp_layout, self.window, True, 1)
        self.process_group, self.cp_layout, self.cp_strategy = process_group, cp_layout, cp_strategy
        self.cp_sync_bias_grads = cp_sync_bias_grads
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim, self.vdim, self.batch_first = kdim, vdim, batch_first
        self.position_bias = position_bias
        self.is_causal, self.cross_attention = is_causal, cross_attention
        self.backend, self.convention, self.scale = backend, convention, scale
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias, **factory)
        self.k_proj = nn.Linear(kdim, embed_dim, bias=proj_bias, **factory)
        self.v_proj = nn.Linear(vdim, embed_dim, bias=proj_bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias, **factory)

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, position_bias: RelativeBias | None = None, **kwargs: object
    ) -> MultiheadAttention:
        """A relbias layer with the configuration and weights of a :class:`torch.nn.MultiheadAttention`.

        Multi-head attention as in Vaswani et al. 2017, "Attention Is All You Need", §3.2.2:
        ``out_proj(concat_h softmax(q_h k_h^T / sqrt(head_dim)) v_h)``. The result has ``module``'s ``embed_dim``,
        ``num_heads``, ``kdim``, ``vdim``, ``batch_first``, projection biases (torch's ``bias``, here
        ``proj_bias``), parameter dtype and device, training mode and each parameter's ``requires_grad``. The
        weights are copied exactly (no storage is shared with ``module``): torch's ``in_proj_weight`` (3·E, E) is
        split, in this order, into ``q_proj.weight``, ``k_proj.weight`` and ``v_proj.weight`` (E, E) each -- or,
        when ``kdim`` or ``vdim`` differs from ``embed_dim``, ``q_proj_weight`` (E, E), ``k_proj_weight``
        (E, kdim) and ``v_proj_weight`` (E, vdim) are copied -- and ``in_proj_bias`` (3·E,) into the three (E,)
        biases; ``out_proj.weight`` (E, E) and ``out_proj.bias`` (E,) are copied as they are.

        With ``position_bias=None`` the result's :meth:`forward` computes what ``module``'s does for the same
        call, up to rounding (another code path), with the differences :meth:`forward` documents: a query with no
        visible key gives ``out_proj`` of zero where torch gives NaN, and ``is_causal=True`` needs no
        ``attn_mask``. A relbias layer built with the same sizes also loads torch's state dict directly
        (``layer.load_state_dict(module.state_dict())``, the keys translated as above; a position bias's
        parameters are then missing from it: ``strict=False``); ``bias_k``/``bias_v`` in it are an error.

        Args:
            module: the torch layer (not modified).
            position_bias: a :class:`relbias.RelativeBias` with 1 or ``num_heads`` heads, or None (default: no
                position bias, torch's scores).
            **kwargs: the constructor's other keyword arguments (``is_causal``, ``cross_attention``, ``backend``,
                ``convention``, ``scale``, ``window``, ``process_group``, ``cp_layout``, ``cp_strategy``,
                ``cp_sync_bias_grads``) with the constructor's defaults, except ``convention``: default
                "additive", torch's scaled scores ``(q·k) / sqrt(head_dim)`` with the bias added unscaled, so that
                the trained weights keep their scores (a bias module's own convention, e.g. T5Bias's unscaled
                "t5", would change them). Keys and values of another length than the query (torch's
                cross-attention) need ``cross_attention=True``.

        Returns:
            A :class:`MultiheadAttention` whose parameters have ``module``'s dtype and device.

        Raises:
            TypeError: ``module`` is not a :class:`torch.nn.MultiheadAttention`; a keyword that ``module`` decides
                (``embed_dim``, ``num_heads``, ``kdim``, ``vdim``, ``batch_first``, ``proj_bias``, ``device``,
                ``dtype``: convert the result instead, e.g. ``layer.to(dtype)``); ``bias`` (the position bias is
                ``position_bias``); a keyword the constructor does not take (torch's ``dropout``, ...).
            ValueError: what relbias' layer cannot carry over, each named with its value: ``add_bias_kv=True``
                (``bias_k``, ``bias_v``), ``add_zero_attn=True``, a ``dropout`` other than 0 (relbias' layer has
                no attention dropout; where the layer runs without it, e.g. for inference, set
                ``module.dropout = 0.0`` first), ``in_proj_bias`` without ``out_proj.bias`` or the reverse,
                parameters of several dtypes or on several devices, parameters or buffers torch's layer does not
                have (a subclass's); and every error of the constructor.

        Example:
            >>> import torch
            >>> from relbias.nn import MultiheadAttention
            >>> torch_layer = torch.nn.MultiheadAttention(64, 4, batch_first=True)
            >>> layer = MultiheadAttention.from_torch(torch_layer)   # position_bias=... adds a relative bias
            >>> x = torch.randn(2, 10, 64)
            >>> torch.allclose(layer(x, x, x)[0], torch_layer(x, x, x)[0], atol=1e-5)
            True
        """
        return from_torch_layer(cls, module, position_bias, kwargs)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """``nn.Module``'s, after translating a :class:`torch.nn.MultiheadAttention` state dict's keys (in place)."""
        translate_torch_state(state_dict, prefix, self.embed_dim, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)

    def _layout(self, features: str) -> str:
        batched = "(batch, seq_len, " if self.batch_first else "(seq_len, batch, "
        return f"{batched}{features}) with batch_first={self.batch_first}, or (seq_len, {features}) unbatched"

    def _to_batch_first(self, name: str, x: object, features: int, feature_name: str, batched: bool | None):
        """Check ``x``'s rank and width; return it as (B, L, F) and whether the call is batched."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor {self._layout(f'{feature_name}={features}')}, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != features or (batched is not None and (x.dim() == 3) != batched):
            expected = self._layout(f"{feature_name}={features}")
            if batched is not None and x.dim() in (2, 3) and (x.dim() == 3) != batched:
                expected += f" (same rank as query, {3 if batched else 2}-D)"
            raise ValueError(f"{name} must be {expected}, got {tuple(x.shape)}")
        self._check_like_parameters(name, x)
        if x.dim() == 2:
            return x.unsqueeze(0), False
        return (x if self.batch_first else x.transpose(0, 1)), True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cache: KVCache | StaticKVCache | None = None,
        cache_position: int | None = None,
        cu_seqlens: torch.Tensor | list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value``; torch.nn.MultiheadAttention's signature and return.

        Shape legend: B batch, Lq query length, S key length (self-attention: cached plus new keys, i.e.
        ``cache_position + Lq``, or with a ``window`` the keys the cache holds plus the new ones; cross-attention:
        the memory's Lm), E embed_dim, H num_heads. Batched inputs are (B, L, F) with
        ``batch_first=True`` and (L, B, F) otherwise; unbatched inputs are (L, F) (then masks drop B).

        Args:
            query: (B, Lq, E) / (Lq, B, E) / (Lq, E), float, the parameters' dtype and device (or
                under ``torch.autocast``).
            key: kdim features. Self-attention: the query's tokens (same length; default ``query``).
                Cross-attention: the memory (Lm tokens); may be None when ``cache`` already holds the
                memory (then reused, and any key/value given is ignored).
            value: vdim features, same length as ``key``; default ``key``.
            key_padding_mask: (B, S) (or (S,) unbatched); bool, **True marks a padding key to ignore**,
                or float, added to the scores (as torch; a float mask of only 0s and 1s is refused: it would mask
                nothing, so it is a 0/1 padding mask passed in the wrong dtype). With a window and a cache that
                dropped keys, S may also be ``cache_position + Lq`` (every position so far, as without a window):
                the layer then reads its last columns, those of the keys held.
            need_weights: also return the attention weights (default True, as torch). They are
                materialised by the reference backend, O(B·H·Lq·S) memory, and the output then comes
                from that same pass; pass False for the configured (memory-lean) backend.
            attn_mask: (Lq, S) or (B·H, Lq, S); bool, **True = NOT allowed** (as torch), or float,
                added to the scores (-inf to mask; only 0s and 1s is refused, as for key_padding_mask). With a
                self-attention cache, S includes the cached keys (with a window, as for key_padding_mask).
            average_attn_weights: weights averaged over heads (B, Lq, S) when True (default), per head
                (B, H, Lq, S) otherwise. Only with ``need_weights``.
            is_causal: hide keys at positions after the query's (absolute positions, as below). Unlike
                torch it needs no ``attn_mask`` (torch treats it as a hint that ``attn_mask`` is causal;
                passing both here applies both, which is the same thing). The layer's own ``is_causal``
                applies in any case.
            cache: relbias extra, keyword only. Self-attention: a :class:`KVCache` or
                :class:`StaticKVCache`; the new keys and values are written at ``cache_position`` and the
                queries attend to positions ``0 .. cache_position + Lq - 1``. With a ``window`` the layer calls
                ``cache.update_window`` instead: the cache keeps only the keys the window reaches (a
                :class:`StaticKVCache` rolls over its capacity) and the queries attend to the held keys at their
                absolute positions (``cache.key_start`` is the first). Cross-attention: a cache
                (of either class) filled from the memory on first use and reused afterwards; it
                counts the decoded target tokens in ``cache.query_position``. A cache serves one layer.
            cache_position: relbias extra, keyword only: absolute position (tokens) of the first query
                in the target sequence; default ``cache.query_position`` (append), or 0 without a cache.
                With a cache it must lie in ``[0, cache.query_position]`` (smaller rewinds); without a
                cache it must be 0 for self-attention and may be any int >= 0 for cross-attention.
            cu_seqlens: relbias extra, keyword only: packed variable-length sequences. ``query`` holds several
                sequences concatenated along the length, batch 1 ((1, T, E) with ``batch_first``, (T, 1, E)
                without, or (T, E)), and ``cu_seqlens`` their N + 1 boundaries (0, ..., T); each token attends only
                within its sequence, at positions restarting from 0 (:func:`relbias.attention_varlen`).
                Self-attention only; no masks, cache or ``need_weights``.

        Returns:
            ``(output, weights)``: output in the query's layout and dtype, (B, Lq, E) / (Lq, B, E) /
            (Lq, E); weights None when ``need_weights`` is False, else (B, Lq, S) or (B, H, Lq, S) ((Lq, S)
            or (H, Lq, S) unbatched), in the query's dtype, each row summing to 1 -- or all zeros for a
            query with no visible key (torch gives NaN there; so does its output, where relbias gives
            ``out_proj`` of zero). With a window and a self-attention cache, the S columns are the keys attended
            to, positions ``max(0, cache_position - left) .. cache_position + Lq - 1``.

        Raises:
            TypeError: a non-tensor input; a query, key or value that is not floating point, or (outside
                ``torch.autocast``) whose dtype differs from the layer's parameters (the message names each such
                input and its dtype, and the inputs that have the parameters' dtype); a mask that is neither bool
                nor float.
            ValueError: wrong ranks (key/value of another rank than query) or feature sizes; inputs on
                another device than the layer's parameters; a self-attention key of another length than
                the query; key and value of different lengths; missing memory for cross-attention; a
                mask of the wrong shape; a bad cache position (with a window: one whose window reaches keys the
                cache dropped, or a StaticKVCache smaller than the window's left side once it rolls); a cache of
                the other kind; and every error
                of :func:`relbias.attention` (e.g. offsets a per-offset bias cannot evaluate with
                clipping off).
        """
        self._check_input_dtypes(query, key, value)
        if cu_seqlens is not None:
            return self._forward_packed(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal,
                                        cache, cache_position, cu_seqlens)
        if self.process_group is not None:
            from ..distributed.module import sharded_forward

            return sharded_forward(
                self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal, cache, cache_position
            )
        q_in, batched = self._to_batch_first("query", query, self.embed_dim, "embed_dim", None)
        batch, q_len = q_in.shape[0], q_in.shape[1]
        if cache_position is not None and (
            isinstance(cache_position, bool) or not isinstance(cache_position, int) or cache_position < 0
        ):
            raise ValueError(f"cache_position must be an int >= 0 (tokens), got {cache_position!r}")
        if cache is not None:
            start = cache.query_position if cache_position is None else cache_position
            if self.cross_attention:  # self-attention: cache.update checks it against the cached keys
                _check_query_position(start, cache.query_position)
        else:
            start = 0 if cache_position is None else cache_position
        q = self._heads(self.q_proj(q_in))
        if self.cross_attention:
            blocks = [KeyBlock(0, *self._memory_kv(key, value, cache, batched))]
        else:
            k_in, v_in = self._self_key_value(query, key, value, q_len, batched)
            k, v = self._heads(self.k_proj(k_in)), self._heads(self.v_proj(v_in))
            if cache is None:
                if start != 0:
                    raise ValueError("cache_position without a cache: pass cache= to decode incrementally")
                blocks = [KeyBlock(0, k, v)]
            elif self.window is None:
                blocks = [KeyBlock(0, *cache.update(k, v, start))]
            else:  # the cache keeps only the keys the window's left side reaches (O(W) memory)
                blocks = cache.update_window(k, v, start, self.window[0])
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        held = sum(block.key.shape[2] for block in blocks)  # S: the keys attended to, positions blocks[0].start on
        # masks may cover every key position so far (start + Lq, as without a window) or only the keys held
        every = held if self.cross_attention or cache is None else start + q_len
        mask = self._merge_masks(key_padding_mask, attn_mask, batch, q_len, held, batched, q, every)
        call = dict(
            bias=self.position_bias, is_causal=self.is_causal or is_causal, scale=self.scale,
            convention=self.convention, query_start=start, window=self.window,
        )
        weights = None
        if need_weights:
            k = blocks[0].key if len(blocks) == 1 else torch.cat([block.key for block in blocks], dim=2)
            v = blocks[0].value if len(blocks) == 1 else torch.cat([block.value for block in blocks], dim=2)
            out, weights = attention_with_weights(q, k, v, mask=mask, key_start=blocks[0].start, **call)
            if average_attn_weights:  # (B, H, Lq, D), (B, H, Lq, S)
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = self._attend(q, blocks, mask, call)  # (B, H, Lq, D)
        if self.cross_attention and cache is not None:
            cache.advance(start, q_len)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))  # (B, Lq, E)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attend(self, q: torch.Tensor, blocks: list[KeyBlock], mask: torch.Tensor | None, call: dict) -> torch.Tensor:
        """:func:`relbias.attention` of ``q`` over the key runs ``blocks`` (consecutive positions, in order), each at
        its own ``key_start``; ``mask`` (4-D, last dim the keys of every block, or None) is split along with them.

        One run is one call. A rolling buffer whose window wraps around its end gives two runs (views, not
        reordered): attending over each and merging by log-sum-exp is exact (one softmax over the union of
        disjoint key sets) and costs one more call, where putting the keys in position order would copy the
        window's keys and values at every step, as much memory traffic as the attention itself. (Under
        torch.compile the buffer gathers one run instead: see ``StaticKVCache._views``.)"""
        if len(blocks) == 1:
            return attention(q, blocks[0].key, blocks[0].value, mask=mask, key_start=blocks[0].start,
                             backend=self.backend, **call)
        from ..distributed.merge import merge_partials

        out = lse = None
        at = 0
        for block in blocks:
            width = block.key.shape[2]
            part_mask = None if mask is None else mask[..., at : at + width]  # (B|1, H|1, Lq, width)
            part = attention(q, block.key, block.value, mask=part_mask, key_start=block.start, backend=self.backend,
                             return_lse=True, **call)
            out, lse = part if out is None else merge_partials(out, lse, *part)
            at += width
        return out

    def _forward_packed(self, query, key, value, kpm, need_weights, attn_mask, is_causal, cache, cache_position,
                        cu_seqlens):
        """forward with ``cu_seqlens``: packed sequences in one row, attention within each."""
        from ..varlen import attention_varlen

        refused = [name for name, given in (
            ("cross_attention", self.cross_attention), ("process_group", self.process_group is not None),
            ("key_padding_mask", kpm is not None), ("attn_mask", attn_mask is not None),
            ("need_weights=True", need_weights), ("cache", cache is not None or cache_position is not None),
        ) if given]
        if refused:
            raise ValueError(f"cu_seqlens (packed sequences) does not combine with {', '.join(refused)}: packed "
                             f"self-attention needs no padding mask, and weights, caches and shards are per sequence")
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        q_in, batched = self._to_batch_first("query", query, self.embed_dim, "embed_dim", None)
        if q_in.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along the length: batch must be 1, got "
                             f"{q_in.shape[0]}")
        q_len = q_in.shape[1]
        k_in, v_in = self._self_key_value(query, key, value, q_len, batched)
        q, k, v = self._heads(self.q_proj(q_in)), self._heads(self.k_proj(k_in)), self._heads(self.v_proj(v_in))
        out = attention_varlen(q, k, v, cu_seqlens, bias=self.position_bias, is_causal=self.is_causal or is_causal,
                               scale=self.scale, convention=self.convention, backend=self.backend, window=self.window)
        out = self.out_proj(out.transpose(1, 2).reshape(1, q_len, self.embed_dim))
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def _self_key_value(self, query, key, value, q_len: int, batched: bool | None):
        """Self-attention's key and value inputs, batch first: default the query's own tokens, which they must be.

        Raises:
            ValueError: a value without a key, or keys / values of another length than the query's ``q_len``
                (under a process group: the local shard's length).
        """
        if key is None and value is not None:
            raise ValueError("value given without key; pass key too (self-attention: usually key = value = query)")
        k_src = query if key is None else key
        k_in, _ = self._to_batch_first("key", k_src, self.kdim, "kdim", batched)
        v_in, _ = self._to_batch_first("value", k_src if value is None else value, self.vdim, "vdim", batched)
        if k_in.shape[1] != q_len or v_in.shape[1] != q_len:
            raise ValueError(
                f"self-attention keys and values are the query's own tokens: their length must be the "
                f"query's {q_len}, got key {k_in.shape[1]} and value {v_in.shape[1]} (cross_attention=True "
                f"attends to another sequence)"
            )
        return k_in, v_in

    def _memory_kv(self, key, value, cache: KVCache | StaticKVCache | None, batched: bool):
        """Cross-attention keys and values (B, H, Lm, D): from a cache holding the memory, or projected."""
        if cache is not None and cache.holds_memory:
            return cache.key[:, :, : cache.length], cache.value[:, :, : cache.length]
        if key is None:
            raise ValueError(
                "cross-attention needs the memory as key (and value), or a cache already filled from it"
            )
        k_in, _ = self._to_batch_first("key", key, self.kdim, "kdim", batched)
        v_in, _ = self._to_batch_first("value", key if value is None else value, self.vdim, "vdim", batched)
        if k_in.shape[:2] != v_in.shape[:2]:
            raise ValueError(f"key and value must agree in batch and length, got {tuple(key.shape)} and {tuple(value.shape)}")
        k, v = self._heads(self.k_proj(k_in)), self._heads(self.v_proj(v_in))
        if cache is not None:
            cache.set_memory(k, v)
        return k, v

    def _check_like_parameters(self, name: str, x: torch.Tensor) -> None:
        """``x`` must be floating point and on the parameters' device (dtypes: :meth:`_check_input_dtypes`)."""
        weight = self.q_proj.weight
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.device != weight.device:
            raise ValueError(f"{name} is on {x.device} but the layer's parameters are on {weight.device}; move one of them")

    def _check_input_dtypes(self, query: object, key: object, value: object) -> None:
        """Outside ``torch.autocast``, the floating-point tensors among ``query``, ``key`` and ``value`` (those given)
        must have the parameters' dtype. O(1): dtypes only.

        Raises:
            TypeError: naming every input whose dtype differs, its dtype, the parameters' dtype and the inputs that
                have it, e.g. "key is torch.float32 but the layer's parameters are torch.bfloat16, as is query".
                Non-tensor and non-float inputs are left to the later checks (which name them).
        """
        expected = self.q_proj.weight.dtype
        given = [(name, x) for name, x in (("query", query), ("key", key), ("value", value))
                 if isinstance(x, torch.Tensor) and x.is_floating_point()]
        wrong = [(name, x.dtype) for name, x in given
                 if x.dtype != expected and not torch.is_autocast_enabled(x.device.type)]
        if not wrong:
            return
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, dtype in wrong:
            by_dtype.setdefault(dtype, []).append(name)
        right = [name for name, x in given if x.dtype == expected]
        stated = " and ".join(f"{join_names(names)} {'is' if len(names) == 1 else 'are'} {dtype}"
                              for dtype, names in by_dtype.items())
        message = f"{stated} but the layer's parameters are {expected}"
        if right:
            message += f", as {'is' if len(right) == 1 else 'are'} {join_names(right)}"
        message += (f": query, key and value must all have the parameters' dtype {expected} (outside torch.autocast); "
                    f"convert {join_names([name for name, _ in wrong])} with .to({expected})")
        if len(by_dtype) == 1:
            (other,) = by_dtype
            message += f", or {join_names(['the layer', *right])} with .to({other})"
        raise TypeError(message + ", or run under torch.autocast")

    def _merge_masks(self, kpm, attn_mask, batch: int, q_len: int, s_len: int, batched: bool, q: torch.Tensor,
                     every: int | None = None):
        """torch's key_padding_mask and attn_mask -> one relbias mask broadcastable to (B, H, Lq, S).

        Both bool: True = may attend (the negation of torch's). Either float: additive, bool parts
        become 0 / -inf. ``every``: the key positions so far (a windowed cache's ``start + Lq``, of which the last
        ``s_len`` are held): a mask over all of them is cut to its last ``s_len`` columns.
        """
        every = s_len if every is None else every
        if every != s_len:
            kpm, attn_mask = (m[..., every - s_len :] if isinstance(m, torch.Tensor) and m.dim() >= 1
                              and m.shape[-1] == every else m for m in (kpm, attn_mask))
        parts = []
        if kpm is not None:
            if not isinstance(kpm, torch.Tensor) or not (kpm.dtype == torch.bool or kpm.is_floating_point()):
                kind = kpm.dtype if isinstance(kpm, torch.Tensor) else type(kpm).__name__
                raise TypeError(f"key_padding_mask must be a bool (True = padding) or float (additive) tensor, got {kind}")
            expected = (batch, s_len) if batched else (s_len,)
            if tuple(kpm.shape) != expected:
                held = "" if every == s_len else f" (or key_len = {every}, every position so far)"
                raise ValueError(
                    f"key_padding_mask must be (batch, key_len) = {expected}{held} (self-attention with a cache: "
                    f"cached plus new keys), got {tuple(kpm.shape)}" if batched else
                    f"key_padding_mask of an unbatched call must be (key_len,) = {expected}{held}, got "
                    f"{tuple(kpm.shape)}"
                )
            if kpm.device != q.device:
                raise ValueError(f"key_padding_mask is on {kpm.device} but query is on {q.device}")
            check_additive_mask(kpm, "key_padding_mask", "pass (mask == 0) where 1 marks a kept token (Hugging "
                                "Face's attention_mask), or mask.bool() where 1 marks padding (True = padding)")
            parts.append(kpm.reshape(batch, 1, 1, s_len))
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor) or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
                kind = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
                raise TypeError(f"attn_mask must be a bool (True = NOT allowed) or float (additive) tensor, got {kind}")
            if attn_mask.device != q.device:
                raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}")
            check_additive_mask(attn_mask, "attn_mask", "pass mask.bool() where 1 marks a pair that may not attend "
                                "(True = NOT allowed), or (mask == 0) where 1 marks one that may")
            per_head = (batch * self.num_heads, q_len, s_len)
            if tuple(attn_mask.shape) == (q_len, s_len):
                parts.append(attn_mask.reshape(1, 1, q_len, s_len))
            elif tuple(attn_mask.shape) == per_head:
                parts.append(attn_mask.reshape(batch, self.num_heads, q_len, s_len))
            else:
                held = "" if every == s_len else f" (or key_len = {every}, every position so far)"
                raise ValueError(
                    f"attn_mask must be (query_len, key_len) = {(q_len, s_len)} or (batch * num_heads, query_len, "
                    f"key_len) = {per_head}{held}, got {tuple(attn_mask.shape)}"
                )
        if not parts:
            return None
        if all(p.dtype == torch.bool for p in parts):
            mask = ~parts[0]
            for p in parts[1:]:
                mask = mask & ~p
            return mask
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        mask = None
        for p in parts:
            add = torch.zeros(p.shape, dtype=dtype, device=p.device).masked_fill(p, float("-inf")) \
                if p.dtype == torch.bool else p.to(dtype)
            mask = add if mask is None else mask + add
        return mask

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, is_causal={self.is_causal}, "
            f"cross_attention={self.cross_attention}, batch_first={self.batch_first}, backend={self.backend!r}"
            + ("" if self.window is None else f", window={self.window}")
            + ("" if self.process_group is None else f", cp_layout={self.cp_layout!r}, cp_strategy={self.cp_strategy!r}")
        )
