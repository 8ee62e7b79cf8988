"""MPT (``MptModel`` and its heads) through :func:`relbias.integrations.alibi_decoders.patch_alibi`.

MPT (MosaicML 2023, llm-foundry) uses ALiBi with :func:`relbias.mpt_alibi_slopes` of ``alibi_bias_max`` (8 in
transformers' MPT, whatever ``attn_config.alibi_bias_max`` says: see :func:`slopes`) and scores ``(q . k) *
softmax_scale + bias + Mask`` (relbias' "additive" convention), positions counted with padding: offsets, whatever
the mask. transformers' MPT slices a (H, 1, max_seq_len) bias to the keys, so it cannot run past
``config.max_seq_len``; the patched attention reads the bias per offset and can. The replacement of
``MptAttention.forward`` keeps transformers' projection, ``clip_qkv``, cache update and output projection; MPT's
mask is True where a key is hidden.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from ..biases.alibi import mpt_alibi_slopes
from .alibi_common import ALiBiPatch, alibi_attention, dropout_probability, replace_forwards
from .common import first_instance

__all__ = ["TRANSFORMERS_ALIBI_BIAS_MAX", "base_model", "check", "install", "slopes", "uninstall"]

#: The ``alibi_bias_max`` transformers' ``MptModel.forward`` builds its bias with (its method's default; the
#: config's ``attn_config.alibi_bias_max`` is not passed).
TRANSFORMERS_ALIBI_BIAS_MAX = 8.0


def base_model(model: nn.Module) -> nn.Module | None:
    """The first ``MptModel`` in ``model``, or None."""
    return first_instance(model, "mpt.modeling_mpt", "MptModel")


def check(base: nn.Module) -> None:
    """Refuse an MPT configured without ALiBi (``attn_config.alibi=False``): it has no relative bias."""
    if not getattr(base.config.attn_config, "alibi", True):
        raise TypeError("this MPT has attn_config.alibi=False (no position bias); relbias patches ALiBi models")


def slopes(base: nn.Module) -> torch.Tensor:
    """MPT's slopes as transformers' ``MptModel`` builds them (float32, (H,)): with ``alibi_bias_max`` 8, the
    default of its ``build_mpt_alibi_tensor``, which its forward calls without the config's value. A config with
    another ``attn_config.alibi_bias_max`` gets a warning: the patch keeps transformers' outputs, so 8 as well."""
    configured = float(base.config.attn_config.alibi_bias_max)
    if configured != TRANSFORMERS_ALIBI_BIAS_MAX:
        warnings.warn(
            f"attn_config.alibi_bias_max={configured:g}, but transformers' MPT builds its slopes with "
            f"{TRANSFORMERS_ALIBI_BIAS_MAX:g} whatever the config says; the patched model keeps transformers' outputs "
            f"(slopes of {TRANSFORMERS_ALIBI_BIAS_MAX:g}). For the configured slopes, run relbias.attention with "
            f"ALiBiBias(num_heads, slopes=relbias.mpt_alibi_slopes(num_heads, {configured:g}))",
            stacklevel=3,
        )
    return mpt_alibi_slopes(base.num_heads, TRANSFORMERS_ALIBI_BIAS_MAX)


def _attention(layer, patch: ALiBiPatch, hidden_states, position_bias=None, cache=None, attention_mask=None,
               **kwargs):
    """Replacement of ``MptAttention.forward``: ``(output, probabilities or None)``."""
    if cache is None and "past_key_values" in kwargs:  # the name transformers deprecates for ``cache``
        cache = kwargs.pop("past_key_values")
    batch, length = hidden_states.shape[:2]
    mixed = layer.Wqkv(hidden_states)
    if layer.clip_qkv:
        mixed = mixed.clamp(min=-layer.clip_qkv, max=layer.clip_qkv)
    query, key, value = (t.reshape(batch, length, layer.n_heads, layer.head_dim).transpose(1, 2)
                         for t in mixed.chunk(3, dim=2))
    past = 0
    if cache is not None:
        past = cache.get_seq_length(layer.layer_idx)
        key, value = cache.update(key, value, layer.layer_idx, kwargs=kwargs)
    out, probs = alibi_attention(
        patch, query, key, value, None if attention_mask is None else ~attention_mask, query_start=past,
        scale=layer.softmax_scale, convention="additive",
        dropout_p=dropout_probability(layer.attn_dropout_p, layer.training),
        output_attentions=patch.output_attentions, counted_positions=False, additive_fill=False,
    )
    return layer.out_proj(out.transpose(1, 2).reshape(batch, length, -1)), probs


def _record_output_attentions(patch: ALiBiPatch, base: nn.Module, args, kwargs) -> None:
    """Forward pre-hook on ``MptModel``: whether this forward returns attentions (its layers are not told)."""
    wanted = kwargs.get("output_attentions")
    patch.output_attentions = bool(base.config.output_attentions if wanted is None else wanted)


def install(base: nn.Module, patch: ALiBiPatch) -> None:
    """Give each ``MptAttention`` of ``base`` the relbias forward; a pre-hook tells them about attentions."""
    replace_forwards(patch, (block.attn for block in base.blocks), _attention)
    handle = base.register_forward_pre_hook(functools.partial(_record_output_attentions, patch), with_kwargs=True)
    patch.restore["hook"] = handle


def uninstall(base: nn.Module, patch: ALiBiPatch) -> None:
    """The pre-hook removed (:func:`~relbias.integrations.alibi_decoders.unpatch_alibi` restores the layers'
    forwards)."""
    patch.restore.pop("hook").remove()
