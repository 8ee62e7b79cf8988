"""The layers' side of the ALiBi patch, shared by :mod:`relbias.integrations.bloom`, ``mpt`` and ``falcon``: the
patch state a patched model keeps (:class:`ALiBiPatch`), causal ALiBi attention of one layer through
:func:`relbias.attention` (:func:`alibi_attention`) and the instance-level ``forward`` replacement.

:mod:`relbias.integrations.alibi_decoders` (``patch_alibi``) imports the architectures, which import this module;
nothing here imports an architecture or the front door. See ``alibi_decoders`` for how each model's bias is read.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .._gqa import expand_kv_heads
from ..biases.alibi import ALiBiBias
from ..functional import attention, attention_with_weights
from .compiled_masks import compiled_hf_attention
from .hidden_rows import fill_hidden_rows, fill_hidden_weights, hidden_rows
from .masks import dense_key_bias, hf_visible, offsets_count_positions, relbias_mask_from_hf
from .masks import keys_in_one_run as _contiguous  # noqa: F401 - its old name here (pickles name it)

__all__ = ["ALiBiPatch", "alibi_attention", "dropout_probability", "replace_forwards"]


@dataclass
class ALiBiPatch:
    """What a patched model keeps (attribute ``_relbias_alibi_patch``): its architecture module's name, the bias,
    the backend, the patched layers, and what :func:`~relbias.integrations.alibi_decoders.unpatch_alibi`
    restores."""

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
        compiling = torch.compiler.is_compiling()  # positions may be tensors; the graph shares the work anyway
        cached = self._mask_cache
        hit = not compiling and cached is not None and hf_mask is not None and cached[0]() is hf_mask
        if hit and cached[1:3] == (query_start, end):
            return cached[3]
        mask, is_causal = relbias_mask_from_hf(hf_mask, is_causal=True, query_start=query_start)
        # Whether a mask's visible keys form one run is a value a compiled graph cannot branch on: it takes the
        # general (counted) positions there, exact for any mask.
        per_offset = not counted_positions or offsets_count_positions(mask, is_causal, end, read_values=not compiling)
        converted = (mask, is_causal, per_offset, hidden_rows(hf_mask))
        if not compiling:
            self._mask_cache = None if hf_mask is None else (weakref.ref(hf_mask), query_start, end, converted)
        return converted


def replace_forwards(patch: ALiBiPatch, layers, forward: Callable) -> None:
    """Give each attention layer of ``layers`` the instance attribute ``forward = partial(forward, layer, patch)``
    and record it in ``patch.layers``, from which
    :func:`relbias.integrations.alibi_decoders.unpatch_alibi` removes those attributes again."""
    for layer in layers:
        layer.forward = functools.partial(forward, layer, patch)
        patch.layers.append(layer)


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
    fill = dict(scale=scale, additive_fill=additive_fill)
    if not output_attentions and hf_mask is not None:  # compiled: the mask converted when the graph runs
        out = compiled_hf_attention(query, key, value, hf_mask, bias=patch.bias, is_causal=True,
                                    query_start=query_start, scale=scale, convention=convention,
                                    backend=patch.backend, dropout_p=dropout_p, enable_gqa=call["enable_gqa"],
                                    key_bias=key_bias if counted_positions else None)
        if out is not None:
            return fill_hidden_rows(out, query, key, value, hidden, **fill), None
    if per_offset:
        call.update(bias=patch.bias, mask=mask, is_causal=is_causal, convention=convention)
    else:  # the model's own per-key bias, dense, with the mask as it is
        bias = key_bias(hf_visible(hf_mask)[:, 0, -1, :])  # the last query sees every visible key up to it
        call.update(mask=dense_key_bias(bias, hf_mask), is_causal=False)
    if output_attentions:
        expanded_key, expanded_value = expand_kv_heads(query, key, value, call.pop("enable_gqa"))
        _, probs = attention_with_weights(query, expanded_key, expanded_value, **call)
        probs = fill_hidden_weights(probs, hidden)
        return fill_hidden_rows(probs @ expanded_value, query, key, value, hidden, **fill), probs
    if patch.backend is not None:
        call["backend"] = patch.backend
    out = attention(query, key, value, **call)
    return (out if hidden is None else fill_hidden_rows(out, query, key, value, hidden, **fill)), None
