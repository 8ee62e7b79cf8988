"""Run Hugging Face's ALiBi decoders (BLOOM, MPT, Falcon with ``alibi=True``) with relbias attention.

ALiBi (Press et al. 2022, "Train Short, Test Long", ICLR, §3) penalises a past key linearly in its distance:
``-m_h * (i - j)``, a slope ``m_h`` per head. transformers (>= 5.24, < 6) builds it per key instead, as
``m_h * position(j)`` (softmax is invariant to a constant per query row), and adds it in eager attention:

* BLOOM: ``position(j)`` counts the visible tokens before ``j`` (the 2-D attention mask's cumulative sum);
  scores ``(q . k) / sqrt(d) + bias`` ("additive"); a (B·H, 1, Lk) bias and a float (B, 1, Lq, Lk) mask.
* MPT: ``position(j) = j`` (padding counts), a (H, 1, max_seq_len) bias sliced to the keys, which refuses
  sequences past ``config.max_seq_len`` (it cannot broadcast); scores ``(q . k) * softmax_scale + bias``
  ("additive"); slopes :func:`relbias.mpt_alibi_slopes` of ``attn_config.alibi_bias_max``.
* Falcon (``alibi=True``: falcon-rw): as BLOOM's, the slopes and products rounded to bfloat16, with scores
  ``(q . k + bias) / sqrt(d)`` (the "seed" convention); the model folds the bias into a (B, H, Lq, Lk) float mask,
  built once per forward.

:func:`patch_alibi` replaces, on the instances, each attention layer's ``forward`` by one that computes the same
projections and cache update as transformers' and calls :func:`relbias.attention` with one
:class:`relbias.ALiBiBias` (causal, the model's own slopes) read per offset: O(H) bias memory, no (Lq, Lk) bias.
Falcon's model is told not to build its bias (``use_alibi`` set to False on the instance while patched; its
attention mask stays transformers'). Embeddings, masks' construction, caches (``DynamicCache``, ``StaticCache``),
generation (greedy, sampling, beam search) and the heads stay transformers' code; parameters and ``state_dict``
are unchanged.

Exactness. Offsets ``i - j`` equal BLOOM's and Falcon's counted positions' differences when each row's visible
keys are contiguous (no padding, left padding, right padding): then the bias is read per offset. A mask with
hidden keys between visible ones (or one under ``torch.compile``, whose values are not read) takes the exact
path instead: the model's own per-key bias, materialised as a (B, H, Lq, Lk) float mask, as transformers does.
MPT's positions are offsets whatever the mask. transformers' Falcon rounds each ``m_h * position`` to bfloat16:
exact only where those products are (below 256 tokens with 1, 2, 4 or 8 heads), else off by up to 2^-7 of the
product (falcon-rw-1b's 32 heads: from position 3); relbias computes ALiBi exactly with Falcon's slopes
(:mod:`relbias.integrations.falcon`). transformers 5.24's eager Falcon adds the bias twice (in its scores and in
the mask its model folds it into); the patch follows the sdpa path, which adds it once, as both paths do from 5.25.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .._gqa import expand_kv_heads
from ..biases.alibi import ALiBiBias
from ..functional import attention, attention_with_weights
from .common import check_backend, check_transformers_version
from .hidden_rows import fill_hidden_rows, fill_hidden_weights, hidden_rows
from .masks import hf_visible, relbias_mask_from_hf

__all__ = [
    "ARCHITECTURES", "ALiBiPatch", "alibi_attention", "alibi_decoder", "dropout_probability", "is_alibi_patched",
    "patch_alibi", "replace_forwards", "unpatch_alibi",
]

#: Modules under ``relbias.integrations`` that each patch one ALiBi architecture; see :func:`patch_alibi`.
ARCHITECTURES = ("bloom", "mpt", "falcon")
_STATE_ATTR = "_relbias_alibi_patch"


@dataclass
class ALiBiPatch:
    """What a patched model keeps (attribute ``_relbias_alibi_patch``): its architecture module's name, the bias,
    the backend, the patched layers, and what :func:`unpatch_alibi` restores."""

    architecture: str
    base: nn.Module
    bias: ALiBiBias
    backend: str | None
    layers: list
    restore: dict = field(default_factory=dict)
    output_attentions: bool = False  # MPT: set per forward by a pre-hook (its attention is not told)
    _mask_cache: tuple | None = field(default=None, repr=False)  # (weakref to the HF mask, query_start, end, converted)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the per-forward mask conversion behind (it holds a weak reference)."""
        return {**self.__dict__, "_mask_cache": None}

    def relbias_mask(self, hf_mask: torch.Tensor | None, query_start: int, end: int,
                     counted_positions: bool) -> tuple[torch.Tensor | None, bool, bool, torch.Tensor | None]:
        """``(mask, is_causal, per_offset, hidden)``: transformers' mask converted (``relbias_mask_from_hf``),
        whether the bias may be read per offset, and its rows with no visible key
        (:func:`~relbias.integrations.hidden_rows.hidden_rows`); computed once per forward (the mask object every
        layer is handed) and reused by the other layers."""
        cached = self._mask_cache
        hit = cached is not None and hf_mask is not None and cached[0]() is hf_mask
        if hit and cached[1:3] == (query_start, end):
            return cached[3]
        mask, is_causal = relbias_mask_from_hf(hf_mask, is_causal=True, query_start=query_start)
        per_offset = not counted_positions or (is_causal and (mask is None or _contiguous(mask, end)))
        converted = (mask, is_causal, per_offset, hidden_rows(hf_mask))
        self._mask_cache = None if hf_mask is None else (weakref.ref(hf_mask), query_start, end, converted)
        return converted


def _architecture(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def replace_forwards(patch: ALiBiPatch, layers, forward: Callable) -> None:
    """Give each attention layer of ``layers`` the instance attribute ``forward = partial(forward, layer, patch)``
    and record it in ``patch.layers``, from which :func:`unpatch_alibi` removes those attributes again."""
    for layer in layers:
        layer.forward = functools.partial(forward, layer, patch)
        patch.layers.append(layer)


def alibi_decoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(architecture, base model)``: the first ``BloomModel``, ``MptModel`` or ``FalconModel`` in ``model``
    (the model itself, a task head's, a wrapper's), or None (none, or transformers not installed)."""
    for name in ARCHITECTURES:
        base = _architecture(name).base_model(model)
        if base is not None:
            return name, base
    return None


def is_alibi_patched(model: nn.Module) -> bool:
    """True when :func:`patch_alibi` has patched ``model`` and :func:`unpatch_alibi` has not undone it."""
    return isinstance(getattr(model, _STATE_ATTR, None), ALiBiPatch)


def _contiguous(key_padding: torch.Tensor, end: int) -> bool:
    """Whether each row's visible keys among the first ``end`` form one run (pads only before and after)."""
    visible = key_padding.reshape(key_padding.shape[0], -1)[:, :end]
    rises = (visible[:, 1:] & ~visible[:, :-1]).sum(dim=1) + visible[:, 0].long()
    return bool((rises <= 1).all())


def dropout_probability(dropout: nn.Dropout | float, training: bool) -> float:
    """A layer's attention dropout (an ``nn.Dropout`` or its probability) as ``dropout_p``: 0 outside training."""
    return getattr(dropout, "p", dropout) if training else 0.0


def alibi_attention(
    patch: ALiBiPatch,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hf_mask: torch.Tensor | None,
    *,
    query_start: int,
    scale: float,
    convention: str,
    dropout_p: float,
    output_attentions: bool,
    counted_positions: bool,
    key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
    additive_fill: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal ALiBi attention of one patched layer: ``(out (B, H, Lq, D), probabilities (B, H, Lq, Lk) or None)``.

    Args:
        patch: the model's patch (bias and backend).
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D), cache included, ``H`` a multiple of ``Hkv``.
        hf_mask: transformers' 4-D mask, True (bool) or 0 (float) = may attend, or None.
        query_start: position of the first query (the tokens already in the cache); keys start at 0.
        scale: the factor on ``q . k``; convention: "additive" or "seed" (the bias scaled too).
        dropout_p: attention dropout (0 outside training).
        output_attentions: also return the probabilities (materialised).
        counted_positions: the model counts positions over visible tokens (BLOOM, Falcon): offsets equal them only
            for contiguous visible keys.
        key_bias: for counted positions, ``visible (B, Lk) -> (B, H, 1, Lk)``, the model's own per-key bias in
            logits after scaling, for the exact path.
        additive_fill: whether transformers adds its mask to the scores (BLOOM, Falcon) rather than writing it over
            them (MPT's ``masked_fill``): what a query row with no visible key passes back to the query and keys
            (:func:`~relbias.integrations.hidden_rows.fill_hidden_rows`, which gives those rows transformers'
            result).
    """
    if patch.bias.slopes.device != query.device:
        patch.bias.to(query.device)
    mask, is_causal, per_offset, hidden = patch.relbias_mask(hf_mask, query_start, query_start + query.shape[2],
                                                             counted_positions)
    call = dict(scale=scale, query_start=query_start, key_start=0, dropout_p=dropout_p,
                enable_gqa=key.shape[1] != query.shape[1])
    if per_offset:
        call.update(bias=patch.bias, mask=mask, is_causal=is_causal, convention=convention)
    else:  # the model's own per-key bias, dense, with the mask as it is
        visible = hf_visible(hf_mask)
        bias = key_bias(visible[:, 0, -1, :])  # the last query sees every visible key up to it
        call.update(mask=bias.masked_fill(~visible, float("-inf")), is_causal=False)
    fill = dict(scale=scale, additive_fill=additive_fill)
    if output_attentions:
        expanded_key, expanded_value = expand_kv_heads(query, key, value, call.pop("enable_gqa"))
        _, probs = attention_with_weights(query, expanded_key, expanded_value, **call)
        probs = fill_hidden_weights(probs, hidden)
        return fill_hidden_rows(probs @ expanded_value, query, key, value, hidden, **fill), probs
    backend = {} if patch.backend is None else {"backend": patch.backend}
    return fill_hidden_rows(attention(query, key, value, **call, **backend), query, key, value, hidden, **fill), None


def patch_alibi(model: nn.Module, *, backend: str | None = None) -> nn.Module:
    """Make the BLOOM, MPT or ALiBi Falcon decoder in ``model`` compute its attention with :func:`relbias.attention`.

    Outputs equal the unpatched model's up to float rounding (float32: within 1e-5 in the tests; greedy and beam
    tokens identical), with left or right padding, a ``DynamicCache`` or ``StaticCache``; see the module docstring
    for how each model's bias is read and where Falcon's bfloat16 rounding makes transformers' bias differ from
    ALiBi's. MPT takes the slopes transformers' MPT uses (``alibi_bias_max`` 8; a config with another value gets a
    warning). A query with no visible key (a left pad) gets transformers' result, the mean of the values, and its
    gradients (:mod:`relbias.integrations.hidden_rows`). Differences: attention dropout in training runs on relbias'
    counter-based mask (the same distribution, another mask; none on those rows); ``output_attentions`` returns the
    probabilities, materialised (O(B·H·Lq·Lk)). A patched MPT runs past ``config.max_seq_len`` (ALiBi needs no
    table; transformers' MPT fails there to broadcast its bias): how well a model does there is the model's matter.

    Args:
        model: a ``BloomModel``/``MptModel``/``FalconModel``, a ``...ForCausalLM`` or other head, or any module
            holding one: the first such base model in it is patched, in place.
        backend: a relbias backend name for every layer, or None (default): :func:`relbias.attention`'s default.

    Returns:
        ``model``, patched.

    Raises:
        TypeError: no BLOOM, MPT or Falcon model in ``model``; a Falcon with ``alibi=False`` (rotary embeddings,
            no relative bias).
        ValueError: already patched; an unknown backend.
    """
    found = alibi_decoder(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} holds no transformers BLOOM, MPT or Falcon model")
    check_transformers_version()
    name, base = found
    if is_alibi_patched(model):
        raise ValueError(f"this {type(model).__name__} is already patched; call unpatch_alibi(model) first")
    check_backend(backend)
    module = _architecture(name)
    module.check(base)
    slopes = module.slopes(base)
    patch = ALiBiPatch(name, base, ALiBiBias(len(slopes), bidirectional=False, slopes=slopes), backend, [])
    module.install(base, patch)
    setattr(model, _STATE_ATTR, patch)
    return model


def unpatch_alibi(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_alibi`: transformers' own attention again, exactly.

    Raises:
        ValueError: ``model`` is not patched by :func:`patch_alibi`.
    """
    patch = getattr(model, _STATE_ATTR, None)
    if not isinstance(patch, ALiBiPatch):
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch_alibi)")
    for layer in patch.layers:
        del layer.forward  # transformers' own forward again
    _architecture(patch.architecture).uninstall(patch.base, patch)
    delattr(model, _STATE_ATTR)
    return model
