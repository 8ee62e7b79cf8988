"""Reasons shared by the fused backends (structured, flex) for calls they cannot run; each a sentence."""

from __future__ import annotations

import torch

from ...call import AttentionCall

__all__ = [
    "AUTO_REFERENCE_MAX_SCORES", "dropout_reasons", "empty_axis_reasons", "non_finite_reasons", "offset_kernel_reasons",
    "small_block_reasons", "tensor_bias_reasons", "tensor_position_reasons", "window_reasons",
]

#: "auto" passes the tiled backends (flex, structured, blockwise) over for the reference when B·H·Lq·Lk is at
#: most this many scores (4 MiB in float32) and gradients are needed, or at most a quarter of it for inference:
#: below it tiling costs more Python overhead than it saves. Measured with benchmarks/bench_auto.py (T5 with an
#: additive float mask and FIRE, causal and bidirectional, H=8, on AVX-512 and emulated AVX2): the reference was
#: as fast or faster up to 128 x 128 inference and 256 x 256 training calls per head; blockwise was 1.05-2.1x
#: faster from 256 x 256 inference; at 512 x 512 with gradients the two were within 0.8-1.35x of each other either
#: way (blockwise ahead causal, FIRE's bidirectional backward behind), blockwise faster beyond.
AUTO_REFERENCE_MAX_SCORES = 1 << 20


def tensor_bias_reasons(call: AttentionCall) -> list[str]:
    """A materialised bias tensor, or a float mask that requires grad: only the reference takes them."""
    reasons = []
    if isinstance(call.bias, torch.Tensor):
        reasons.append("the bias is a tensor, already materialised (O(N^2)); only the reference takes it")
    if call.mask is not None and call.mask.requires_grad and torch.is_grad_enabled():
        reasons.append("the float mask requires grad; only the reference back-propagates into a mask")
    return reasons


def empty_axis_reasons(call: AttentionCall, kernel: str) -> list[str]:
    """An empty batch, head, head_dim or length axis, on which ``kernel`` (a name) divides by zero."""
    b, h, lq, d = call.query.shape
    dv, lk = call.value.shape[-1], call.alignment.key_len
    if 0 not in (b, h, d, dv, lq, lk):
        return []
    return [
        f"an empty axis (batch {b}, num_heads {h}, head_dim {d}, value head_dim {dv}, query_len {lq}, key_len "
        f"{lk}); {kernel} divides by zero on some of them"
    ]


def non_finite_reasons(call: AttentionCall, kernel: str) -> list[str]:
    """NaN/inf in keys or values, which ``kernel`` (a name) spreads to queries that cannot see them."""
    if call.hidden_keys_finite:
        return []
    return [
        f"a key or value that some query cannot see holds NaN/inf, which {kernel} would spread to that query (0 * inf); "
        f"blockwise confines it to the queries that see it"
    ]


def dropout_reasons(call: AttentionCall, kernel: str) -> list[str]:
    """Attention dropout, whose counter-based mask ``kernel`` (a name) cannot apply."""
    if call.dropout is None:
        return []
    return [
        f"attention dropout (dropout_p={call.dropout.p}) needs relbias' counter-based mask, which {kernel} does not "
        f"draw; reference, blockwise, toeplitz (where its native kernels run) and triton (CUDA) apply it"
    ]


def small_block_reasons(call: AttentionCall) -> list[str]:
    """The small-block rule, as an auto reason of the tiled backends: few scores are cheaper to materialise
    (at most :data:`AUTO_REFERENCE_MAX_SCORES` with gradients, a quarter of it without)."""
    limit = AUTO_REFERENCE_MAX_SCORES if call.needs_grad else AUTO_REFERENCE_MAX_SCORES // 4
    if call.num_scores > limit:
        return []
    what = "with gradients" if call.needs_grad else "for inference"
    return [f"small block: {call.num_scores} scores (<= {limit} {what}), too few to repay tiling (a single fused "
            f"kernel call or materialising them costs less)"]


def tensor_position_reasons(call: AttentionCall, backend: str) -> list[str]:
    """Positions that are tensors (torch.compile with a static cache), which ``backend`` (a name) would read in
    Python to plan its tiles or kernel calls."""
    if not isinstance(call.delta, torch.Tensor):
        return []
    return [
        f"the positions are tensors (a compiled static cache); {backend} plans its work from int positions "
        f"(reference and decode run such calls)"
    ]


def offset_kernel_reasons(call: AttentionCall) -> list[str]:
    """Why kernels that read an offset-only bias per offset and a per-key padding row (toeplitz, triton) cannot run
    ``call``: no bias, a bias that reads absolute positions, a mask other than a bool key padding mask."""
    from ...biases.base import RelativeBias

    reasons = []
    bias = call.bias
    if bias is None:
        reasons.append("there is no bias; bias-free attention needs no bias kernel (use blockwise or SDPA)")
    elif isinstance(bias, RelativeBias) and not bias.offset_only:
        reasons.append(f"{type(bias).__name__} reads absolute positions, so its bias has no per-offset values to read")
    if call.mask is not None and call.key_padding is None:
        reasons.append("the mask is not a bool key padding mask (B or 1, H or 1, 1, Lk): the kernels read the "
                       "bias and a per-key padding row, not a mask with a query dimension or a float mask "
                       "(those go to blockwise)")
    return reasons


def window_reasons(call: AttentionCall, backend: str) -> list[str]:
    """A local-attention window (:mod:`relbias.window`), which ``backend`` (a name) does not apply."""
    if call.window is None:
        return []
    return [f"a window {call.window} (left, right): {backend} does not apply one; toeplitz (its native kernels), "
            f"triton, flex, blockwise and reference do, skipping what lies outside it"]
