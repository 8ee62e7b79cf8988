"""BLOOM (``BloomModel`` and its heads) through :func:`relbias.integrations.alibi_decoders.patch_alibi`.

BLOOM (BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", §3.2.3) uses ALiBi
with the slopes of Press et al. 2022 (transformers' ``_get_alibi_slopes``, float32) and scores
``(q . k) / sqrt(d) + bias + Mask``: relbias' "additive" convention. The replacement of ``BloomAttention.forward``
keeps transformers' projection, cache update, output projection (``pretraining_tp`` included) and residual
dropout, and runs the attention itself with :func:`relbias.integrations.alibi_common.alibi_attention`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from .alibi_common import ALiBiPatch, alibi_attention, dropout_probability, replace_forwards
from .common import first_instance

__all__ = ["base_model", "check", "install", "slopes", "uninstall"]


def base_model(model: nn.Module) -> nn.Module | None:
    """The first ``BloomModel`` in ``model``, or None."""
    return first_instance(model, "bloom.modeling_bloom", "BloomModel")


def check(base: nn.Module) -> None:
    """Every BLOOM configuration runs patched: nothing to refuse."""


def slopes(base: nn.Module) -> torch.Tensor:
    """BLOOM's slopes as transformers computes them (float32, (H,))."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(base.num_heads, torch.device("cpu"))


def _attention(layer, patch: ALiBiPatch, hidden_states, residual, alibi, attention_mask, layer_past=None,
               use_cache=False, output_attentions=False, **kwargs):
    """Replacement of ``BloomAttention.forward``: ``(output, probabilities or None)``, as transformers'."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch, length, _ = hidden_states.shape
    fused = layer.query_key_value(hidden_states).view(batch, length, layer.num_heads, 3, layer.head_dim)
    query, key, value = (t.transpose(1, 2) for t in fused.unbind(3))  # (B, H, L, D) each, interleaved per head
    past = 0
    if layer_past is not None:
        past = layer_past.get_seq_length(layer.layer_idx)
        key, value = layer_past.update(key, value, layer.layer_idx)
    out, probs = alibi_attention(
        patch, query, key, value, attention_mask, query_start=past, scale=layer.inv_norm_factor,
        convention="additive", dropout_p=dropout_probability(layer.attention_dropout, layer.training),
        output_attentions=output_attentions, counted_positions=True,
        key_bias=lambda visible: alibi.view(batch, layer.num_heads, 1, -1),
    )
    context = out.transpose(1, 2).reshape(batch, length, layer.hidden_size)
    if layer.pretraining_tp > 1 and layer.slow_but_exact:  # transformers' sliced output projection
        step = layer.hidden_size / layer.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(layer.pretraining_tp):
            cols = slice(int(i * step), int((i + 1) * step))
            output = output + F.linear(context[:, :, cols], layer.dense.weight[:, cols])
    else:
        output = layer.dense(context)
    return dropout_add(output, residual, layer.hidden_dropout, layer.training), probs


def install(base: nn.Module, patch: ALiBiPatch) -> None:
    """Give each ``BloomAttention`` of ``base`` the relbias forward."""
    replace_forwards(patch, (block.self_attention for block in base.h), _attention)


def uninstall(base: nn.Module, patch: ALiBiPatch) -> None:
    """Nothing beyond the layers' forwards (:func:`~relbias.integrations.alibi_decoders.unpatch_alibi` restores
    those) to restore."""
