"""The reference backend: plain math on the materialised (B, H, Lq, Lk) scores.

This is the oracle every faster backend is tested against, so it is written to be read, not to be
fast: it materialises the bias and the attention probabilities and computes in float32 (float64 for
float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import torch

from ..biases.base import RelativeBias
from ..call import AttentionCall
from ..positions import Alignment
from .base import Backend

__all__ = ["ReferenceBackend", "reference_attention", "visible_keys"]


def visible_keys(
    mask: torch.Tensor | None, is_causal: bool, alignment: Alignment, device: torch.device,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor:
    """Which keys each query may attend to: bool tensor broadcastable to (B, H, Lq, Lk).

    A key is visible when the causal rule (key position <= query position, under ``alignment``), the
    window (``i - left <= j <= i + right``: offsets ``-right <= i - j <= left``) and the mask all allow it;
    a float mask hides exactly its -inf entries.
    """
    visible = torch.ones(alignment.query_len, alignment.key_len, dtype=torch.bool, device=device)
    offsets = alignment.offsets(device)  # (Lq, Lk): i - j
    if is_causal:
        visible = visible & (offsets >= 0)  # the key is not in the future
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (offsets <= left)  # at most `left` keys back
        if right is not None:
            visible = visible & (offsets >= -right)  # at most `right` keys ahead
    if mask is not None:
        visible = visible & (mask if mask.dtype == torch.bool else mask != float("-inf"))
    return visible


class ReferenceBackend(Backend):
    """The oracle: every call, with the (B, H, Lq, Lk) scores materialised."""

    name = "reference"
    repeatable = True
    summary = "the reference materialises the (B, H, Lq, Lk) scores: runs every call, memory O(B·H·Lq·Lk)"

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        return []

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_attention(call)


def reference_attention(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with a relative bias, computed the plain way, on a validated call.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, Dv) -> out (B, H, Lq, Dv) in the
    dtype of ``query`` and lse (B, H, Lq) in float32 (float64 for float64 inputs), ``-inf`` for a query
    with no visible key. See :func:`relbias.attention` for the formula of each convention; with
    ``call.dropout`` the probabilities are multiplied by its mask (the lse is the undropped one).
    """
    query, key, value, bias, mask = call.query, call.key, call.value, call.bias, call.mask
    alignment, scale, convention = call.alignment, call.scale, call.convention
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    visible = visible_keys(mask, call.is_causal, alignment, query.device, call.window)  # broadcasts to (B, H, Lq, Lk)
    # Keys hidden from every query (padding) must not leak NaN/inf through 0 * NaN, forward or backward.
    unused = ~visible.any(dim=-2).unsqueeze(-1)  # (B or 1, H or 1, Lk, 1)
    zero = torch.zeros((), dtype=compute, device=q.device)
    k, v = torch.where(unused, zero, k), torch.where(unused, zero, v)

    scores = q @ k.transpose(-2, -1)  # (B, H, Lq, Lk), q . k
    if isinstance(bias, RelativeBias) and bias.offset_only and call.window is not None:
        pe = call.native_bias().materialize()  # (H or 1, Lq, Lk); offsets outside the window are not evaluated
    elif isinstance(bias, RelativeBias):
        pe = bias(
            alignment.query_len, alignment.key_len, query_start=alignment.query_start, key_start=alignment.key_start
        )  # (H or 1, Lq, Lk)
    else:
        pe = bias
    if pe is not None:
        pe = pe.to(compute)
    if convention == "seed":  # ((q . k) + PE) * scale
        scores = (scores + pe) * scale if pe is not None else scores * scale
    elif convention == "additive":  # (q . k) * scale + PE
        scores = scores * scale + pe if pe is not None else scores * scale
    else:  # "t5": (q . k) + PE, unscaled
        scores = scores + pe if pe is not None else scores

    if mask is not None and mask.is_floating_point():
        scores = scores + mask.to(compute).masked_fill(~visible, 0.0)  # finite part of the additive mask
    # A masked key gets exactly zero weight, whatever its score: -inf before the softmax.
    scores = scores.masked_fill(~visible, float("-inf"))
    # A row with no visible key would be softmax(all -inf) = NaN: give it finite dummy scores and
    # zero its probabilities afterwards, so its output is 0, its lse -inf and its gradients 0.
    has_key = visible.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~has_key, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~has_key[..., 0], float("-inf"))  # (B, H, Lq)
    probs = torch.softmax(scores, dim=-1).masked_fill(~has_key, 0.0)  # (B, H, Lq, Lk)
    if call.dropout is not None:  # dropout on the probabilities, after the lse (Vaswani et al. 2017, §5.4)
        b, h, lq, _ = query.shape
        probs = probs * call.dropout.scale_tile(b, h, 0, lq, 0, alignment.key_len, query.device, compute)
    if v.device.type == "meta" or torch.compiler.is_compiling() or bool(torch.isfinite(v).all()):  # meta: no values
        return (probs @ v).to(query.dtype), lse  # (B, H, Lq, Dv)
    # NaN/inf values must reach only the queries that see them, not others through 0 * NaN: sum the
    # visible products explicitly ((B, H, Lq, Lk, Dv) memory; only taken when values are non-finite).
    products = torch.where(visible.unsqueeze(-1), probs.unsqueeze(-1) * v.unsqueeze(-3), zero)
    return products.sum(dim=-2).to(query.dtype), lse
