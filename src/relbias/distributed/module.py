"""``MultiheadAttention`` under a process group: the layer's projections around context-parallel attention (self-
attention) or around an all-gather of the memory (cross-attention), on this rank's sequence shard."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..functional import attention
from .api import context_parallel_attention
from .gather import gather_sequence
from .groups import resolve_group
from .layout import shard_pieces

__all__ = ["sharded_forward"]


def sharded_forward(layer, query, key, value, kpm, need_weights, attn_mask, is_causal, cache, cache_position):
    """:meth:`relbias.nn.MultiheadAttention.forward` under the layer's ``process_group``: this rank's shards in (the
    layer's layout; (L/P, E), (B, L/P, E) or (L/P, B, E) by ``batch_first``), ``(this rank's output shard, None)``
    out. Self-attention runs :func:`relbias.distributed.context_parallel_attention` with the layer's ``cp_layout``,
    ``cp_strategy``, ``window`` and bias; cross-attention all-gathers the memory's keys and values
    (:func:`relbias.distributed.gather_sequence`) and attends with the local queries at their global positions.

    Raises:
        ValueError: ``need_weights=True``; an ``attn_mask``; a ``key_padding_mask`` not shaped (B, L/P) (batched)
            or (L/P,); cross-attention without ``key`` or with ``is_causal``; the errors of
            ``context_parallel_attention``.
        TypeError: a non-bool ``is_causal`` or ``key_padding_mask``.
        NotImplementedError: a ``cache`` or ``cache_position``.
        RuntimeError: torch.distributed not initialised.
    """

    if need_weights:
        raise ValueError(
            "need_weights=True is not supported with a process_group (the weights would span every rank's "
            "keys); pass need_weights=False"
        )
    if attn_mask is not None:
        raise ValueError(
            "attn_mask is not supported with a process_group (a (query, key) mask cannot be sharded along the "
            "sequence); use is_causal and a key_padding_mask (bool, this rank's shard)"
        )
    if cache is not None or cache_position is not None:
        raise NotImplementedError(
            "KV caches (cache=, cache_position=) are not supported with a process_group; decode incrementally "
            "with a layer built without process_group (the same parameters, e.g. load its state_dict)"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "MultiheadAttention(process_group=...) needs an initialised torch.distributed; call "
            "torch.distributed.init_process_group first"
        )
    group = resolve_group(layer.process_group, argument="process_group")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    q_in, batched = layer._to_batch_first("query", query, layer.embed_dim, "embed_dim", None)
    batch, q_len = q_in.shape[0], q_in.shape[1]
    q = layer._heads(layer.q_proj(q_in))
    if layer.cross_attention:
        if key is None:
            raise ValueError("cross-attention needs the memory as key (and value): this rank's shard of it")
        k_in, _ = layer._to_batch_first("key", key, layer.kdim, "kdim", batched)
        v_in, _ = layer._to_batch_first("value", key if value is None else value, layer.vdim, "vdim", batched)
        if k_in.shape[:2] != v_in.shape[:2]:
            raise ValueError(f"key and value must agree in batch and length, got {tuple(key.shape)} and {tuple(value.shape)}")
    else:
        k_in, v_in = layer._self_key_value(query, key, value, q_len, batched)
    k, v = layer._heads(layer.k_proj(k_in)), layer._heads(layer.v_proj(v_in))  # (B, H, S/P, D)
    local_keys = k.shape[2]
    keep = None
    if kpm is not None:
        if not isinstance(kpm, torch.Tensor) or kpm.dtype != torch.bool:
            kind = kpm.dtype if isinstance(kpm, torch.Tensor) else type(kpm).__name__
            raise TypeError(f"with a process_group, key_padding_mask must be bool (True = padding), got {kind}")
        expected = (batch, local_keys) if batched else (local_keys,)
        if tuple(kpm.shape) != expected:
            raise ValueError(
                f"with a process_group, key_padding_mask must be this rank's shard of the padding mask, "
                f"{expected} (batch, local key length), got {tuple(kpm.shape)}"
            )
        if kpm.device != q.device:
            raise ValueError(f"key_padding_mask is on {kpm.device} but query is on {q.device}")
        keep = ~kpm.reshape(batch, 1, 1, local_keys)  # True = may attend
    if not layer.cross_attention:
        out = context_parallel_attention(
            q, k, v, bias=layer.position_bias, mask=keep, is_causal=layer.is_causal or is_causal,
            scale=layer.scale, convention=layer.convention, group=group, layout=layer.cp_layout,
            strategy=layer.cp_strategy, sync_bias_grads=layer.cp_sync_bias_grads, window=layer.window,
        )
    else:
        if is_causal:
            raise ValueError("is_causal applies to self-attention; a cross-attention layer sees the whole memory")
        # one collective for both (one backward collective too): (2, B, H, S, D), positions 0 .. S-1
        k, v = gather_sequence(torch.stack([k, v]), dim=3, group=group, layout=layer.cp_layout).unbind(0)
        if keep is not None:
            keep = gather_sequence(keep, dim=3, group=group, layout=layer.cp_layout)
        pieces = shard_pieces(q_len * world_size, world_size, rank, layer.cp_layout)
        outs, at = [], 0
        for start, length in pieces:  # each run of consecutive queries at its global position
            outs.append(attention(
                q[:, :, at : at + length], k, v, bias=layer.position_bias, mask=keep, scale=layer.scale,
                convention=layer.convention, query_start=start, key_start=0, backend=layer.backend,
                window=layer.window,
            ))
            at += length
        out = torch.cat(outs, dim=2)
    out = layer.out_proj(out.transpose(1, 2).reshape(batch, q_len, layer.embed_dim))  # (B, Lq/P, E)
    if not batched:
        out = out.squeeze(0)
    elif not layer.batch_first:
        out = out.transpose(0, 1)
    return out, None
