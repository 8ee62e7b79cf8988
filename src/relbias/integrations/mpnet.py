"""Run Hugging Face MPNet models (``MPNetModel``, ``MPNetForMaskedLM``, the task heads; all-mpnet-base-v2 in
sentence-transformers) with relbias attention.

MPNet (Song et al. 2020, "MPNet: Masked and Permuted Pre-training for Language Understanding", §2.3, following
T5's relative positions) adds one bias table, shared by every layer, to scaled scores:
``softmax((q . k) / sqrt(d) + u_{b(i-j)} + Mask) v``, ``b`` T5's bidirectional bucketing with 32 buckets and
max distance 128 (transformers' ``MPNetEncoder.compute_position_bias`` passes those, whatever the config says).
That is relbias' :class:`relbias.T5Bias` (``bidirectional=True``) in the "additive" convention.

transformers (>= 5.24, < 6) builds the bias as a (B, H, L, L) tensor per forward (``.expand(...).contiguous()``)
and adds it in every layer's eager attention. :func:`patch_mpnet` replaces, on the instances,

* ``MPNetEncoder.compute_position_bias`` by one returning the encoder's ``T5Bias`` (sharing its
  ``relative_attention_bias`` parameter) instead of a tensor, which transformers hands to every layer;
* each ``MPNetSelfAttention.forward`` by one that calls :func:`relbias.attention` with that bias and the layer's
  mask (transformers' additive float mask, converted to a bool key padding mask by
  ``relbias.integrations.masks.relbias_mask_from_hf``).

Projections, embeddings, masks' construction and heads stay transformers' code; parameters and ``state_dict`` are
unchanged. :func:`unpatch_mpnet` removes the instance attributes, so transformers' own methods run again.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..biases.t5 import T5Bias
from ..functional import attention, attention_with_weights
from .hidden_rows import fill_hidden_rows, fill_hidden_weights, hidden_rows
from .compiled_masks import compiled_hf_attention
from .masks import relbias_mask_from_hf
from .common import check_backend, check_model, first_instance
from .patches import find_patches, patched_already

__all__ = ["MPNET_BUCKETS", "MPNET_MAX_DISTANCE", "is_mpnet_patched", "mpnet_encoder", "patch_mpnet", "unpatch_mpnet"]

#: Buckets and max distance (tokens) of MPNet's bucketing, as transformers' ``compute_position_bias`` uses them.
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128
_STATE_ATTR = "_relbias_mpnet_patch"


def mpnet_encoder(model: nn.Module) -> nn.Module | None:
    """The first ``MPNetEncoder`` in ``model.named_modules()`` (the model itself, a task head's, a wrapper's such
    as a sentence-transformers ``SentenceTransformer``), or None (no MPNet in it, or transformers not installed)."""
    return first_instance(model, "mpnet.modeling_mpnet", "MPNetEncoder")


def _patches(model: nn.Module):
    """The MPNet patches inside ``model`` (:func:`relbias.integrations.patches.find_patches`): states
    ``(encoder, layers, backend)``; models pickled before the backend was kept hold ``(encoder, layers)``."""
    return find_patches(model, _STATE_ATTR, lambda state: isinstance(state, tuple))


def is_mpnet_patched(model: nn.Module) -> bool:
    """True when ``model`` is, or holds, a model :func:`patch_mpnet` has patched and :func:`unpatch_mpnet` has not
    restored (whether the encoder's model or a module holding it was handed to :func:`patch_mpnet`)."""
    return bool(_patches(model))


def _position_bias(encoder: nn.Module, bias: T5Bias, x: torch.Tensor, position_ids=None, num_buckets=32) -> T5Bias:
    """Replacement of ``MPNetEncoder.compute_position_bias``: the bias module, no (B, H, L, L) tensor."""
    if position_ids is not None or num_buckets != MPNET_BUCKETS:
        raise NotImplementedError(
            f"patched MPNet reads positions 0..L-1 with {MPNET_BUCKETS} buckets, as MPNetEncoder.forward asks; got "
            f"position_ids={'a tensor' if position_ids is not None else None}, num_buckets={num_buckets}"
        )
    table = encoder.relative_attention_bias.weight
    if bias.weight is not table:  # the model's parameter was replaced (load_state_dict(assign=True))
        bias.weight = table
    return bias


def _self_attention(layer: nn.Module, backend: str | None, hidden_states, attention_mask=None, position_bias=None,
                    output_attentions=False, **kwargs):
    """Replacement of ``MPNetSelfAttention.forward``: (output,) or (output, probabilities), as transformers'."""
    if not isinstance(position_bias, T5Bias):
        raise TypeError(
            f"a patched MPNet layer needs the T5Bias of its patched encoder as position_bias, got "
            f"{type(position_bias).__name__}; patch the whole model with relbias.integrations.transformers.patch"
        )
    shape = (*hidden_states.shape[:-1], -1, layer.attention_head_size)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (layer.q, layer.k, layer.v))  # (B, H, L, D)
    mask, _ = relbias_mask_from_hf(attention_mask, is_causal=False)
    call = dict(bias=position_bias, mask=mask, convention="additive",
                dropout_p=layer.dropout.p if layer.training else 0.0)
    hidden = hidden_rows(attention_mask)  # rows of a sequence that is all padding: transformers' mean of the values
    if output_attentions:
        _, probs = attention_with_weights(q, k, v, **call)  # (B, H, L, L), dropout applied
        probs = fill_hidden_weights(probs, hidden)
        c = probs @ v
    else:  # compiled: the mask converted when the graph runs (compiled_masks); else here
        probs = None
        c = compiled_hf_attention(q, k, v, attention_mask, bias=position_bias, is_causal=False, query_start=0,
                                  scale=None, convention="additive", backend=backend, dropout_p=call["dropout_p"])
        if c is None:
            c = attention(q, k, v, **call, **({} if backend is None else {"backend": backend}))
    c = fill_hidden_rows(c, q, k, v, hidden, scale=layer.attention_head_size ** -0.5, bias=position_bias)
    o = layer.o(c.transpose(1, 2).reshape(*hidden_states.shape[:-1], layer.all_head_size))
    return (o, probs) if output_attentions else (o,)


def patch_mpnet(model: nn.Module, *, backend: str | None = None) -> nn.Module:
    """Make the MPNet encoder in ``model`` compute its attention with :func:`relbias.attention`.

    Outputs equal the unpatched model's up to float rounding (float32: within 1e-5 in the tests) for every MPNet
    head, with padding; scores ``(q . k) / sqrt(d) + u_{b(i-j)} + Mask`` ("additive"), ``u`` the model's
    ``relative_attention_bias`` table read as a bidirectional :class:`relbias.T5Bias` (32 buckets, max distance
    128). A query with no visible key (every query of a sequence that is all padding) gets transformers' result, the
    mean of the values, and its gradients, the bias table's included (:mod:`relbias.integrations.hidden_rows`).
    Differences: attention dropout in training runs on relbias' counter-based mask (the same distribution, another
    mask; none on those rows); ``output_attentions`` returns the probabilities, materialised (O(B·H·L²)).

    Args:
        model: an ``MPNetModel``, ``MPNetForMaskedLM``, ``MPNetFor...`` head, or any module holding one (a
            sentence-transformers ``SentenceTransformer``): the first ``MPNetEncoder`` in it is patched, in place.
        backend: a relbias backend name for every layer, or None (default): :func:`relbias.attention`'s default.

    Returns:
        ``model``, patched.

    Raises:
        TypeError: no ``MPNetEncoder`` in ``model``.
        ValueError: a table of another size than (32, num_heads) (transformers' bucketing reads 32 buckets whatever
            the config says: a table with fewer rows cannot run, one with more has rows never read); an unknown
            backend; ``model`` is, or holds, a model patched already with another backend.

    Warns:
        UserWarning: ``model`` is, or holds, a model patched already with this backend (a head whose base model
            was patched, a base model patched through its head, or the same model twice): nothing changes
            (:mod:`relbias.integrations.patches`).
    """
    check_model(model, "patch_mpnet")
    encoder = mpnet_encoder(model)
    if encoder is None:
        raise TypeError(f"{type(model).__name__} holds no transformers MPNetEncoder; patch_mpnet patches MPNet models")
    check_backend(backend)
    patched = _patches(model)
    if patched:
        state = patched[0].state
        return patched_already(model, patched[0], "patch_mpnet", state[2] if len(state) > 2 else None, backend)
    table = encoder.relative_attention_bias.weight
    if tuple(table.shape) != (MPNET_BUCKETS, encoder.n_heads):
        raise ValueError(
            f"MPNet's relative_attention_bias has shape {tuple(table.shape)}; relbias patches the (32, num_heads) "
            f"table transformers' bucketing reads (relative_attention_num_buckets=32)"
        )
    with torch.random.fork_rng(devices=[]):  # T5Bias draws a random table: keep the caller's stream
        bias = T5Bias(encoder.n_heads, num_buckets=MPNET_BUCKETS, max_distance=MPNET_MAX_DISTANCE, bidirectional=True)
    bias.weight = table
    encoder.compute_position_bias = functools.partial(_position_bias, encoder, bias)
    layers = [layer.attention.attn for layer in encoder.layer]
    for layer in layers:
        layer.forward = functools.partial(_self_attention, layer, backend)
    setattr(encoder, _STATE_ATTR, (encoder, layers, backend))  # on the module it changes (module docstring)
    return model


def unpatch_mpnet(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_mpnet`: transformers' own ``compute_position_bias`` and attention again, exactly, in every
    patched encoder inside ``model`` (whichever module holding it was handed to :func:`patch_mpnet`).

    Returns:
        ``model``, unpatched.

    Raises:
        ValueError: ``model`` neither is nor holds a model patched by :func:`patch_mpnet`.
    """
    patched = _patches(model)
    if not patched:
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch_mpnet)")
    for _, holder, (encoder, layers, *_) in patched:
        del encoder.compute_position_bias
        for layer in layers:
            del layer.forward
        delattr(holder, _STATE_ATTR)
    return model
