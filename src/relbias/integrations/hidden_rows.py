"""transformers' output for a query row whose keys are all hidden, given by the patches where relbias gives zeros.

transformers hides a key with a finite fill, ``finfo(dtype).min``: its eager attention adds it to the scores (BLOOM,
Falcon, T5, MPNet) or writes it over them (MPT's ``masked_fill``), and its "sdpa" path hands torch's
``scaled_dot_product_attention`` a float mask holding it (T5 with its bias, ALiBi Falcon). In a row whose every key
is hidden (a left pad of a causal batch, or every row of a sequence that is all padding) each score then rounds to
that minimum, softmax gives each of the ``Lk`` keys the weight ``1/Lk``, and the row's output is the mean of the
values. Its gradient is softmax's at those uniform weights: ``g_i / Lk`` to every value and, where the fill is
*added* to the scores, ``dS_ij = g_i . (v_j - mean v) / Lk`` to every score, which reaches the query, the keys and a
learnable bias added before the mask (T5's and MPNet's tables in eager attention; T5's "sdpa" path selects the
bias with ``torch.where``, so none reaches it there). ``output_attentions`` shows the weights ``1/Lk``.

:func:`relbias.attention` gives such a row zeros (docs/conventions.md, Masks). The patches replace those rows, and
only those, by :func:`fill_hidden_rows`, which computes the mean and the gradients above in closed form, without
scores: ``O(B·H·(Lq + Lk)·D²)`` operations for the query and keys and, for a learnable bias, an (H, n, Lk) bias over
the ``n`` query positions that have a hidden row (``O(B·H·n·Lk·D)`` operations). :func:`hidden_rows` finds the rows
from transformers' mask (one reduction of it per forward); without a mask, or with no hidden row, the patched
attention does no further work. Under ``torch.compile`` nothing reads the mask's values: the rows are selected with
``torch.where`` over every query (``n = Lq``).

Not reproduced: the attention dropout transformers applies in training to those uniform weights (the rows get the
plain mean), and the backward of torch's CPU flash SDPA kernel, which gives such a row ``Lk`` times the gradient of
its own forward (the row's log-sum-exp ``finfo.min + log Lk`` rounds back to ``finfo.min``, so each weight is
recomputed as 1); the gradients here are those of transformers' eager attention and of SDPA's math kernel.
"""

from __future__ import annotations

import torch

from ..biases.base import RelativeBias
from .masks import hf_visible

__all__ = ["fill_hidden_rows", "fill_hidden_weights", "hidden_rows"]


def hidden_rows(hf_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The query rows of a transformers 4-D mask that see no key: bool (B, 1 or H, Lq, 1), True = hidden row.

    Args:
        hf_mask: None, or transformers' mask (bool True = may attend, or additive float, ``<= finfo.min / 2`` or -inf
            hiding a key), (B, 1 or H, Lq, Lk).

    Returns:
        None when there is no mask or (outside ``torch.compile``, where the mask's values are read) no hidden row;
        else the rows, for :func:`fill_hidden_rows`.
    """
    if hf_mask is None:
        return None
    hidden = ~hf_visible(hf_mask).any(dim=-1, keepdim=True)
    if not torch.compiler.is_compiling() and not bool(hidden.any()):
        return None
    return hidden


def _positions_to_fill(hidden: torch.Tensor) -> torch.Tensor | None:
    """The query positions (int64) at which some batch element or head has a hidden row; None for every position
    (under ``torch.compile``, which reads no values, or when every position has one)."""
    if torch.compiler.is_compiling():
        return None
    rows = hidden.flatten(0, 1).any(dim=0).flatten().nonzero().flatten()  # (n,)
    return None if rows.numel() == hidden.shape[2] else rows


def fill_hidden_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor | None,
    *,
    scale: float,
    additive_fill: bool = True,
    bias: RelativeBias | None = None,
    query_start: int | torch.Tensor = 0,
) -> torch.Tensor:
    """``out`` with its ``hidden`` rows replaced by transformers' result there: the mean of the values, with the
    gradients of softmax at uniform weights (module docstring).

    Args:
        out: (B, H, Lq, Dv), relbias' attention output (zeros in the hidden rows).
        query: (B, H, Lq, D); key: (B, Hkv, Lk, D); value: (B, Hkv, Lk, Dv), H a multiple of Hkv (query head ``h``
            reads key/value head ``h // (H // Hkv)``); keys start at position 0.
        hidden: :func:`hidden_rows` of the layer's mask, bool (B, 1 or H, Lq, 1), or None (``out`` is returned).
        scale: the factor on ``q . k`` in the scores.
        additive_fill: True where transformers adds its fill to the scores (eager ``scores + mask``, a float mask in
            SDPA): the rows' gradient reaches the query and keys (and ``bias``); False where it writes the fill over
            them (``masked_fill``): only the values get one.
        bias: the relative bias added, in logits, to the scores before the mask, when transformers' hidden rows pass
            a gradient to it (T5's table in eager attention, MPNet's); None otherwise.
        query_start: absolute position of the first query (tokens), for ``bias``.

    Returns:
        (B, H, Lq, Dv) in ``out``'s dtype; ``out`` itself when ``hidden`` is None.
    """
    if hidden is None:
        return out
    rows = _positions_to_fill(hidden)
    if rows is not None:
        query, hidden = query.index_select(2, rows), hidden.index_select(2, rows)
    group = query.shape[1] // value.shape[1]
    compute = torch.promote_types(value.dtype, torch.float32)
    v = value.to(compute)
    mean = v.mean(dim=2, keepdim=True)  # (B, Hkv, 1, Dv): uniform weights 1 / Lk
    fill = mean.repeat_interleave(group, dim=1) if group > 1 else mean
    scores_grad = additive_fill and torch.is_grad_enabled()
    wants_qk = scores_grad and (query.requires_grad or key.requires_grad)
    wants_bias = scores_grad and bias is not None and any(p.requires_grad for p in bias.parameters())
    if wants_qk or wants_bias:
        # First order in the scores at uniform weights: o_i = mean + (1/Lk) sum_j dS_ij (v_j - mean), dS written with
        # zero-valued tensors (x - x.detach()) whose gradient is the identity: the value stays the mean exactly.
        key_len = value.shape[2]
        centred = v - mean  # (B, Hkv, Lk, Dv)
        q, k = query.to(compute), key.to(compute)
        steps = []
        if wants_qk:
            kv = k.transpose(-2, -1) @ centred  # (B, Hkv, D, Dv): sum_j k_j (v_j - mean)^T
            kv_step = (k - k.detach()).transpose(-2, -1) @ centred
            if group > 1:
                kv, kv_step = kv.repeat_interleave(group, dim=1), kv_step.repeat_interleave(group, dim=1)
            steps.append(scale * ((q - q.detach()) @ kv + q @ kv_step))  # (B, H, n, Dv)
        if wants_bias:
            positions = torch.arange(hidden.shape[2], device=query.device) if rows is None else rows
            keys = torch.arange(key_len, device=query.device)
            values = bias.pair_values(positions + query_start, keys).to(compute)  # (H or 1, n, Lk)
            values = values.expand(query.shape[1], -1, -1)
            centred_h = centred.repeat_interleave(group, dim=1) if group > 1 else centred
            steps.append(torch.einsum("hnk,bhkd->bhnd", values - values.detach(), centred_h))
        fill = fill + sum(steps) / key_len
    fill = fill.to(out.dtype)
    if rows is None:
        return torch.where(hidden, fill, out)
    return out.index_copy(2, rows, torch.where(hidden, fill, out.index_select(2, rows)))


def fill_hidden_weights(weights: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Attention probabilities (B, H, Lq, Lk) with the ``hidden`` rows (:func:`hidden_rows`) at ``1/Lk``, the
    weights transformers shows there; ``weights`` itself when ``hidden`` is None."""
    if hidden is None:
        return weights
    return torch.where(hidden, torch.full((), 1.0 / weights.shape[-1], dtype=weights.dtype,
                                          device=weights.device), weights)
