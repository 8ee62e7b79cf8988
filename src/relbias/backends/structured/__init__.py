"""The structured backend: exact attention for biases that are constant far from the diagonal.

Some biases take one value per head and direction beyond a distance T (the T5 bias beyond its last
bucket's start, 91 bidirectional / 113 causal for 32 buckets and max_distance 128; a per-offset bias
with ``out_of_range="clip"`` beyond L - 1). A constant added to every score of a set of keys is
absorbed by softmax into that set's log-sum-exp, so attention splits into three exact parts:

* far past keys, offset ``i - j >= T``, bias ``c_past``: bias-free fused attention on shifted slices
  (e.g. ``q[T:]`` against ``k[:N-T]`` with a causal mask);
* far future keys, offset ``<= -T`` (bidirectional only), bias ``c_future``: the same, mirrored;
* the band ``|i - j| < T``: the tiled kernel with the bias looked up per tile.

The parts are merged by log-sum-exp: ``lse = logsumexp_p(lse_p + c_p)``,
``out = sum_p exp(lse_p + c_p - lse) out_p``. Backward calls each fused part's backward with the merged
output and the global ``lse - c_p``, which yields exactly that part's share of dq, dk, dv; the band
recomputes its tiles; the gradient of a constant is ``sum_i w_i (dO_i . out_p,i - D_i)`` with
``w_i = exp(lse_p,i + c_p - lse_i)`` and ``D_i = dO_i . O_i`` (sums over batch and rows, in a fixed
order: deterministic). Saved for backward: O(B·H·L·D).

Sources: the bucket saturation of T5 (Raffel et al. 2020, JMLR 21(140), §2.1) and Shaw et al.'s clipping
(2018, NAACL, §3); merging partial softmaxes by their log-sum-exp as in FlashAttention's split-KV /
Flash-Decoding (Dao et al. 2022, 2023); the backward formulas of FlashAttention (Dao et al. 2022, Alg. 2).

Forward and backward are ``torch.library`` custom ops (:mod:`relbias.backends.structured._kernel`; the far parts in
:mod:`relbias.backends.structured._parts`), so a compiled model calls each as one node; eager calls run the same
functions through a plain ``autograd.Function``.

Requirements (the dispatcher checks them and says why when one fails): an offset-only bias with a
``far_constant_distance()``, no ``mask`` or a bool key padding mask (query dimension 1: padded keys are
hidden in every part, through the fused kernel's additive ``attn_mask`` and in the band tiles), int positions (not
the tensor positions of a compiled static cache), and a device with a fused kernel that exposes its log-sum-exp
(CPU here).
"""

from __future__ import annotations

import torch

from ...biases.base import RelativeBias
from ...call import AttentionCall
from .._shared.cpu_flash import cpu_flash_reasons
from .._shared.reasons import (
    dropout_reasons, non_finite_reasons, small_block_reasons, tensor_bias_reasons, tensor_position_reasons,
    window_reasons,
)
from ._kernel import structured_apply
from ._parts import far_parts
from ..base import Backend

__all__ = ["BLOCK_Q", "StructuredBackend", "far_distance", "far_parts", "structured_attention"]

#: Default query rows per band tile (tokens); a band tile spans BLOCK_Q + 2T - 2 keys.
BLOCK_Q = 64

def far_distance(bias: object) -> int | None:
    """The distance T (tokens, >= 1) beyond which ``bias`` is one constant per direction, or None."""
    if not isinstance(bias, RelativeBias) or not bias.offset_only:
        return None
    distance = bias.far_constant_distance()
    return None if distance is None else max(1, int(distance))


class StructuredBackend(Backend):
    """Far-constant biases: bias-free fused attention far from the diagonal plus a tiled band."""

    name = "structured"
    repeatable = True
    summary = "far-constant bias: fused bias-free far parts (CPU flash kernel) plus a tiled band, merged by log-sum-exp; memory O(N·D)"

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tensor_bias_reasons(call) + dropout_reasons(call, "the fused far parts")
        reasons += tensor_position_reasons(call, "structured") + window_reasons(call, "structured")
        bias = call.bias
        if bias is None:
            reasons.append("there is no bias; bias-free attention needs no band (use blockwise or SDPA)")
        elif isinstance(bias, RelativeBias):
            if not bias.offset_only:
                reasons.append(f"{type(bias).__name__} reads absolute positions, so it is not constant far from the diagonal")
            elif far_distance(bias) is None:
                reasons.append(
                    f"{type(bias).__name__} is not constant beyond a distance (T5Bias and PerOffsetBias with "
                    f"out_of_range='clip' are)"
                )
        if call.mask is not None and call.key_padding is None:
            reasons.append(
                "the mask is not a bool key padding mask (B or 1, H or 1, 1, Lk); the fused far parts take only "
                "that (float masks and masks with a query dimension go to blockwise)"
            )
        reasons += cpu_flash_reasons(call)
        return reasons or non_finite_reasons(call, "the fused far parts")

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        return small_block_reasons(call)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return structured_attention(call)


def structured_attention(call: AttentionCall, *, block_q: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with a far-constant bias: fused bias-free far parts + a tiled near band, merged by
    log-sum-exp, on a validated call that :class:`StructuredBackend` accepts. See :func:`relbias.attention`
    for the formula.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, D) -> out (B, H, Lq, D) in the dtype of
    ``query`` and lse (B, H, Lq) float32 (float64 for float64 inputs). ``block_q``: query rows
    per band tile (tokens), default :data:`BLOCK_Q`.

    Precision: parts are merged through their log-sum-exp, which float32 holds to ``|lse| x 2^-24``; with
    scores of order 1e4 (T5's unscaled scores on large activations) that is a relative error of ~1e-3 in
    the merge weights, where the reference (one softmax) stays near 1e-7. float16 inputs therefore run
    in float64; float32 inputs with such scores are better served by the blockwise backend.

    Mask: None or a key padding mask (:attr:`relbias.call.AttentionCall.key_padding`), bool (B or 1,
    H or 1, 1, Lk), True = may attend. Padded keys are hidden from the fused far parts (as their additive
    attn_mask) and from the band tiles; a row that sees no key gets output 0, lse -inf and zero gradients.
    """
    query, alignment = call.query, call.alignment
    values = call.bias.native_for(alignment, query.device).values
    settings = (
        float(call.scale), float(call.bias_scale), alignment.query_start, alignment.key_start, call.is_causal,
        far_distance(call.bias), block_q or BLOCK_Q,
    )
    keep_parts = values.requires_grad and torch.is_grad_enabled()  # the constants' gradient reads the far parts
    out, lse = structured_apply(query, call.key, call.value, values, call.key_padding, settings, keep_parts)
    return out.to(query.dtype), (lse.float() if query.dtype == torch.float16 else lse)
