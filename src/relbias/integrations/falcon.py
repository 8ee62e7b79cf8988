"""Falcon with ALiBi (``FalconModel`` with ``config.alibi=True``: falcon-rw) through
:func:`relbias.integrations.alibi_decoders.patch_alibi`.

Falcon-RW (Penedo et al. 2023, "The RefinedWeb Dataset for Falcon LLM", §4.1) uses ALiBi with scores ``(q . k +
bias) / sqrt(d) + Mask``, relbias' "seed" convention. transformers computes the slopes as BLOOM's, rounds them to
bfloat16 and multiplies them by the counted positions in bfloat16 (8 significant bits; the positions are rounded
too); relbias reads those rounded slopes and computes ``-m_h * (i - j)`` exactly. The two agree where transformers'
products are exact (below 256 tokens when every slope is a power of two: 1, 2, 4 or 8 heads); elsewhere
transformers' bias is off by up to 2^-7 of ``m_h * position`` (the position and the product are each rounded)
(falcon-rw-1b's 32 heads: from position 3), and the patched model's outputs differ from transformers' by that
rounding of transformers', not only by float32 rounding. While patched, the model's ``use_alibi`` is False on the
instance, so that its forward builds no (B, H, Lq, Lk) bias-and-mask tensor (it then also computes rotary tables,
which the patched attention does not read). The replacement of ``FalconAttention.forward`` keeps transformers'
projections and cache update; it splits the fused query/key/value projection itself (:func:`split_heads`, the
checkpoint layout: multi-query and the new decoder architecture included, key/value heads shared by groups of query
heads and cached unrepeated).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .alibi_common import ALiBiPatch, alibi_attention, dropout_probability, replace_forwards
from .common import first_instance

__all__ = ["base_model", "check", "install", "slopes", "split_heads", "uninstall"]


def base_model(model: nn.Module) -> nn.Module | None:
    """The first ``FalconModel`` in ``model``, or None."""
    return first_instance(model, "falcon.modeling_falcon", "FalconModel")


def check(base: nn.Module) -> None:
    """Refuse a Falcon without ALiBi (``config.alibi=False``: rotary embeddings, no relative bias)."""
    if not base.config.alibi:
        raise TypeError("this Falcon has config.alibi=False (rotary embeddings, no relative bias); relbias patches "
                        "ALiBi Falcon models (falcon-rw)")


def _alibi(visible: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' Falcon bias for a (B, Lk) mask of visible keys: (B, H, 1, Lk), logits before scaling."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    return build_alibi_tensor(visible.long(), num_heads, dtype).view(visible.shape[0], num_heads, 1, -1)


def slopes(base: nn.Module) -> torch.Tensor:
    """Falcon's slopes as transformers computes them (float32 values of its bfloat16 slopes, (H,))."""
    return _alibi(torch.ones(1, 2, dtype=torch.bool), base.num_heads, torch.float32)[0, :, 0, 1]


def split_heads(layer: nn.Module, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query (B, H, L, D), key and value (B, Hkv, L, D) of ``layer.query_key_value``'s output (B, L, ·), in
    Falcon's checkpoint layout: the new decoder architecture groups each key/value head's queries then its key and
    value; multi-query puts the H queries then one key and one value; the original interleaves query, key and value
    per head. Views of ``fused``; key/value heads are not repeated."""
    batch, length, _ = fused.shape
    heads, head_dim = layer.num_heads, layer.head_dim
    if layer.new_decoder_architecture:
        grouped = fused.view(batch, length, layer.num_kv_heads, -1, head_dim)
        query, key, value = grouped[..., :-2, :].flatten(2, 3), grouped[..., -2, :], grouped[..., -1, :]
    elif layer.multi_query:
        query, key, value = fused.view(batch, length, heads + 2, head_dim).split([heads, 1, 1], dim=2)
    else:
        query, key, value = fused.view(batch, length, heads, 3, head_dim).unbind(3)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _attention(layer, patch: ALiBiPatch, hidden_states, alibi=None, attention_mask=None, position_ids=None,
               layer_past=None, use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """Replacement of ``FalconAttention.forward``: ``(output, probabilities or None)``."""
    query, key, value = split_heads(layer, layer.query_key_value(hidden_states))
    batch, _, length, _ = query.shape
    past = 0
    if layer_past is not None:
        past = layer_past.get_seq_length(layer.layer_idx)
        key, value = layer_past.update(key, value, layer.layer_idx)
    head_dim = layer.head_dim
    out, probs = alibi_attention(
        patch, query, key, value, attention_mask, query_start=past, scale=layer.inv_norm_factor,
        convention="seed", dropout_p=dropout_probability(layer.attention_dropout, layer.training),
        output_attentions=output_attentions, counted_positions=True,
        key_bias=lambda visible: _alibi(visible, layer.num_heads, query.dtype) / math.sqrt(head_dim),
    )
    return layer.dense(out.transpose(1, 2).reshape(batch, length, layer.num_heads * head_dim)), probs


def install(base: nn.Module, patch: ALiBiPatch) -> None:
    """Give each ``FalconAttention`` of ``base`` the relbias forward; the model builds no bias."""
    replace_forwards(patch, (block.self_attention for block in base.h), _attention)
    patch.restore["use_alibi"] = base.use_alibi
    base.use_alibi = False


def uninstall(base: nn.Module, patch: ALiBiPatch) -> None:
    """The model's own ``use_alibi`` again (:func:`~relbias.integrations.alibi_decoders.unpatch_alibi` restores the
    layers' forwards)."""
    base.use_alibi = patch.restore.pop("use_alibi")
