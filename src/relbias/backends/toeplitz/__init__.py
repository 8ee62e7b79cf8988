"""The toeplitz backend: every offset-only bias at the speed of bias-free fused attention (CPU).

An offset-only bias ``PE(i, j) = f_h(i - j)`` is, per head, a Toeplitz matrix: constant along each
diagonal. Its native form (:meth:`relbias.RelativeBias.native`) holds the Lq + Lk - 1 distinct values;
reversed and scaled, ``w`` (:func:`relbias.backends.toeplitz._view.reversed_bias`), query ``i`` and key ``j`` read
``w[Lq - 1 - i + j]``, so a query row reads a contiguous window of ``w`` and no (H, Lq, Lk) tensor is ever formed.

Forward and backward are fused C++ kernels (:mod:`relbias.backends.toeplitz._native`, compiled on first use with
``torch.utils.cpp_extension``: about 50 s on 2 cores once per machine kind; they need a C++ compiler with OpenMP and
``ninja``): FlashAttention-2's forward (Dao 2023, Alg. 1; online softmax over key tiles, causal tiles beyond the
diagonal skipped) and backward (Alg. 2; ``P`` and ``dS = P * (dP - D)`` formed once per (query tile, key tile),
giving dq, dk, dv and the bias gradient ``dPE(t) = sum_{i - j = t} dS_ij`` in one elementwise pass), parallel over
batch x heads (x query tiles, forward), deterministic (fixed summation order).

Where they cannot be built (or ``RELBIAS_NATIVE=0``), the forward reads ``w`` through a strided view (strides 1, 1,
query rows of a block in reverse order) as the additive ``attn_mask`` of PyTorch's CPU flash kernel, one call per
block of :data:`BLOCK_Q` query rows against the keys the block can see; the backward is that kernel's (no bias
gradient) or the native kernel's pass in PyTorch (:mod:`relbias.backends.toeplitz._backward`). Everything runs with
denormals flushed to zero on every thread (the native kernels on each of their threads, the PyTorch paths through
:func:`relbias.backends._shared.denormals.flush_denormals`): ALiBi's far keys otherwise land in float32 denormals
(measured: forward 1.4x, backward 4x slower); exponentials are clamped at -87.
Saved for backward: O(B·H·L·D).

Under ``torch.compile`` forward and backward are ``torch.library`` custom ops
(:mod:`relbias.backends.toeplitz._kernel`), so a model compiled with ``fullgraph=True`` calls each as one node;
eager calls run the same functions through a plain ``autograd.Function``.

Attention dropout runs inside the native kernels: the counter-based mask of :mod:`relbias._dropout` (the entries
the reference and blockwise drop, for the same seed) is generated per tile in the forward, after the row sums, and
regenerated in the backward; no (B, H, Lq, Lk) tensor exists. Without the native kernels, dropout goes to
blockwise.

A bool key padding mask (B or 1, H or 1, 1, Lk), the form patched Hugging Face models pass, is one more additive
row per (batch, head) in both kernels (0 or -inf: a padded key's weight is exactly 0), and key tiles that are wholly
padding are skipped; a query whose keys are all padded gets out 0 and lse -inf.

Requirements (the dispatcher says which fails): an offset-only bias module, no mask or a bool key padding mask,
no dropout unless the native kernels run, CPU, equal query and value head_dim, int positions (not the tensor
positions of a compiled static cache). float16 and bfloat16 inputs run the native forward and backward in half
precision where the CPU has matrix units for them (AMX-BF16, AMX-FP16:
:func:`~relbias.backends.toeplitz._native.runs_half`), with the bias, scores, softmax and the bias gradient in
float32; elsewhere they run on float32 copies (a half-precision mask would round the bias).
"""

from __future__ import annotations

import torch

from ...biases.base import RelativeBias
from ...call import AttentionCall
from .._shared.cpu_flash import cpu_flash_reasons
from .._shared.reasons import (
    non_finite_reasons, offset_kernel_reasons, tensor_bias_reasons, tensor_position_reasons,
)
from .._shared.masks import additive_mask
from ._kernel import part_backward, toeplitz_apply
from ._native import HALF_UNITS, half_precision_notes, native_unavailable_reason
from ._native import takes as _native_takes
from .._shared.dtypes import compute_dtype
from ...window import kernel_sides
from ..base import Backend

__all__ = [
    "BLOCK_Q", "STRUCTURED_GRAD_MIN_SCORES", "TILE", "ToeplitzBackend", "toeplitz_attention", "toeplitz_part_backward",
]

#: Query rows per fused kernel call (tokens); causal calls waste about BLOCK_Q / 2 keys per row on the diagonal.
BLOCK_Q = 512
#: Query x key scores per head above which ``auto`` leaves a far-constant bias (T5, clipped per-offset) that needs
#: gradients to structured when the native backward is unavailable (measured against the Python tiled pass:
#: structured faster at 4096 x 4096, toeplitz at 2048 x 2048 and below; the native backward is faster at both).
STRUCTURED_GRAD_MIN_SCORES = 1 << 23
#: Rows and keys per tile of the backward pass that also gives the bias gradient (tokens).
TILE = 256


class ToeplitzBackend(Backend):
    """Offset-only biases: the bias as a strided Toeplitz view, the additive mask of fused CPU flash attention."""

    name = "toeplitz"
    repeatable = True
    summary = (
        "offset-only bias read from its per-offset values, no mask or a bool key padding mask, dropout inside the "
        "native kernels: fused C++ FlashAttention-2 forward and backward (built on first use; else PyTorch's CPU "
        "flash kernel with the bias as a strided view); memory O(N·D)"
    )

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tensor_bias_reasons(call) + tensor_position_reasons(call, "toeplitz")
        if call.dropout is not None and call.query.device.type == "cpu":
            why_not_native = native_unavailable_reason()  # builds the native kernels on the first call
            if why_not_native is not None:
                reasons.append(f"attention dropout (dropout_p={call.dropout.p}) runs in the native kernels only, "
                               f"which are unavailable ({why_not_native}); blockwise applies it")
        if call.window is not None and call.query.device.type == "cpu":
            why_not_native = native_unavailable_reason()
            if why_not_native is not None:
                reasons.append(f"a window {call.window} runs in the native kernels only, which are unavailable "
                               f"({why_not_native}); blockwise applies it")
        reasons += offset_kernel_reasons(call)
        reasons += cpu_flash_reasons(call)
        return reasons or non_finite_reasons(call, "the fused kernel")

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        # No small-block rule: one kernel call per query block beats materialising the scores at every size
        # measured (64 to 724 tokens, T5 and KERPLE, forward and forward+backward: 1.1-7x faster than the reference).
        bias = call.bias
        far_constant = isinstance(bias, RelativeBias) and bias.offset_only
        a = call.alignment
        if call.needs_grad and a.query_len * a.key_len > STRUCTURED_GRAD_MIN_SCORES and far_constant and \
                bias.far_constant_distance():
            why_not_native = native_unavailable_reason()  # builds the native backward on the first call
            if why_not_native is not None:
                return [
                    f"gradients are needed over {a.query_len}x{a.key_len} scores per head, {type(bias).__name__} is "
                    f"constant far from the diagonal and the native backward is unavailable ({why_not_native}): "
                    f"structured's backward needs no tiled pass for the bias gradient (T5, forward+backward at "
                    f"4096 tokens, measured: 1.3-1.4x bias-free SDPA, against 1.6x for the Python tiled pass)"
                ]
        return []

    def explain(self, call: AttentionCall) -> str:
        passes = "forward and backward" if call.needs_grad else "forward"
        device = call.query.device.type
        why_not_native = native_unavailable_reason() if device == "cpu" else f"on {device}"
        if why_not_native is None:
            how = f"the bias read from its per-offset values inside relbias' fused C++ FlashAttention-2 {passes}"
            if call.dropout is not None:
                how += ", dropout inside the kernels"
            if call.query.dtype in HALF_UNITS and not _native_takes(call.query):
                dtype = str(call.query.dtype).removeprefix("torch.")
                how += f", on float32 copies of the {dtype} inputs (see the note)"
        else:
            how = (f"the bias read from its per-offset values as a strided view, the additive mask of PyTorch's fused "
                   f"attention (relbias' native kernels do not run: {why_not_native})")
            if call.needs_grad:
                how += "; the backward in PyTorch, tiled"
        return f"{how}; memory O(N·D)"

    def notes(self, call: AttentionCall) -> list[str]:
        return half_precision_notes(call.query)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return toeplitz_attention(call)


def toeplitz_attention(
    call: AttentionCall, *, block_q: int | None = None, tile: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with an offset-only bias on a validated call that :class:`ToeplitzBackend` accepts; the
    formula is :func:`relbias.attention`'s.

    Shapes: query (B, H, Lq, D), key and value (B, H, Lk, D) on CPU -> out (B, H, Lq, D) in the dtype of
    ``query``, lse (B, H, Lq) in float32 (float64 for float64 inputs), -inf (and out 0) for a query that sees
    no key. float16 and bfloat16 inputs: the forward and the backward in half precision where the native kernels run
    them (:func:`~relbias.backends.toeplitz._native.runs_half`; the backward's GEMMs on the inputs with P and dS
    rounded to the dtype, everything else in float32), else on float32 copies; the gradients in the inputs' dtype
    (the bias's in its own). ``block_q``: query rows per kernel call (tokens),
    default :data:`BLOCK_Q`; ``tile``: rows and keys per tile of the backward with a bias gradient, default :data:`TILE`.

    Precision: the backward recomputes ``p = exp(s - lse)`` from the stored log-sum-exp, which float32 holds to
    ``|lse| x 2^-24``; with scores of order 1e3 the gradients err about 5e-4 relative (the kernel's own backward),
    and with scores beyond ~1e7 (a bias of 1e30, a scale of 1e20) they are wrong while the output is right. The
    reference backend, one softmax, has no such limit. A query holding +-inf whose every score is -inf gets out 0
    (the reference: NaN); it still reaches no other query.
    """
    native = call.native_bias()
    query, key, value = _compute_inputs(call, half=True)
    padding = _key_padding(call, compute_dtype(query.dtype))
    out, lse = toeplitz_apply(query, key, value, native.values, _plan(call, block_q, tile), padding)
    return out.to(call.query.dtype), lse


def toeplitz_part_backward(
    call: AttentionCall, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients one part of a merged result contributes, the part being :func:`toeplitz_attention` of
    ``call`` (a context-parallel ring block), without recomputing it.

    ``grad_out`` (B, H, Lq, Dv): gradient of the merged output; ``out`` (B, H, Lq, Dv) and ``lse`` (B, H, Lq): the
    merged output and log-sum-exp, float32 (float64 for float64 inputs). Returns (dq, dk, dv) in the compute dtype
    (float32 for half-precision inputs), the bias's native ``values`` (Hb, M), recorded for autograd where the
    bias parameters require grad, and their gradient ``dvalues`` (empty when they do not): pass both to
    ``torch.autograd.grad`` for the parameters' share. FlashAttention's split-KV merge (Dao et al. 2023).
    """
    with torch.enable_grad():
        values = call.native_bias().values
    query, key, value = (t.detach() for t in _compute_inputs(call))
    padding = _key_padding(call, query.dtype)
    dq, dk, dv, dvalues = part_backward(grad_out, query, key, value, values, out, lse, _plan(call, None, None),
                                        padding)
    return dq, dk, dv, values, dvalues


def _compute_inputs(call: AttentionCall, half: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value; float16 and bfloat16 as float32 copies (a half-precision additive mask would round the
    bias), unless ``half`` and the native forward runs them in half precision here
    (:func:`~relbias.backends.toeplitz._native.runs_half`: the CPU's matrix units for that dtype)."""
    query, key, value = call.query, call.key, call.value
    if query.dtype in (torch.float16, torch.bfloat16) and not (half and _native_takes(query)):
        query, key, value = query.float(), key.float(), value.float()
    return query, key, value


def _key_padding(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor | None:
    """The kernels' padding row (Bm, Hm, Lk) for a call with a key padding mask, 0 / -inf in ``dtype``; else None."""
    mask = additive_mask(call.key_padding, dtype)
    return None if mask is None else mask[:, :, 0]


def _plan(call: AttentionCall, block_q: int | None, tile: int | None) -> dict:
    plan = {
        "scale": call.scale, "bias_scale": call.bias_scale, "delta": call.delta, "is_causal": call.is_causal,
        "block_q": block_q or BLOCK_Q, "tile": tile or TILE,
    }
    if call.window is not None:  # the kernels skip every tile outside the band (-1: no bound on that side)
        a = call.alignment
        plan["window_left"], plan["window_right"] = kernel_sides(call.window, a.min_offset, a.max_offset)
    if call.dropout is not None:  # the counter-based mask at the call's absolute positions (relbias._dropout)
        d = call.dropout
        plan.update(dropout_p=d.p, seed=d.seed, query_start=int(d.query_start), key_start=int(d.key_start))
    return plan
