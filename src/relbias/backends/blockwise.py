"""The blockwise backend: tiled attention in plain PyTorch that never materialises the (H, Lq, Lk) bias.

Query blocks x key blocks with an online softmax in float32 (Milakov & Gimelshein 2018; Dao et al.
2022, FlashAttention, Alg. 1-2). Each tile reads its bias from the native per-offset vector
(``values[:, offsets - min_offset]``), or, for a family that reads absolute positions
(``offset_only = False``), from ``pair_values`` of the tile. Tiles wholly outside the causal rule or the window
(:mod:`relbias.window`) are skipped, and a window's interior blocks run batched
(:mod:`relbias.backends._shared.band_interior`): time O(Lq·W). The backward pass recomputes each tile from the saved output and log-sum-exp, so what is kept
for backward is O(B·H·L·D). The gradient of the native vector is summed along tile diagonals in a
fixed order: bit-identical across runs.

Works on any device and float dtype. Limitations: a bias given as a tensor is not supported (it is
already materialised; use the reference), a float mask receives no gradient, and there are no
second-order gradients (the backward is once-differentiable).
"""

from __future__ import annotations

import torch

from ..biases.base import RelativeBias
from ..call import AttentionCall
from ..positions import Alignment
from ._shared.autograd import first_order
from ._shared.bias_tiles import NativeSource, PairSource
from ._shared.denormals import flush_denormals_for
from ._shared.dtypes import compute_dtype
from ._shared.tiled_kernel import TileProblem, tiled_backward, tiled_forward
from ._shared.reasons import small_block_reasons, tensor_bias_reasons, tensor_position_reasons
from .base import Backend

__all__ = ["BLOCK_K", "BLOCK_Q", "BlockwiseBackend", "blockwise_attention", "make_source"]

#: Default tile: queries x keys per step (tokens). Peak scratch is about 4 such float32 tiles x B x H.
BLOCK_Q = 256
BLOCK_K = 1024
#: Tile side when keys or values hold NaN/inf (products are then summed per entry: (B, H, T, T, D) memory).
CAREFUL_BLOCK = 32


def make_source(bias, alignment: Alignment, convention: str, scale: float, compute: torch.dtype, device,
                values: torch.Tensor | None = None):
    """Bias tiles for ``bias`` and the tensors through which its gradient flows; ``values``: the native per-offset
    values (Hb, Lq + Lk - 1) of an offset-only bias when the caller has them (a windowed call's), else computed.

    Returns:
        (source, inputs, kind): ``source`` a NativeSource / PairSource or None; ``inputs`` the tensors
        to pass through the autograd Function (the native values (Hb, Lq + Lk - 1), or the module's
        trainable parameters); ``kind`` "native", "pair" or "none".

    Raises:
        TypeError: ``bias`` is a tensor (already materialised: use backend="reference").
    """
    if bias is None:
        return None, [], "none"
    if not isinstance(bias, RelativeBias):
        raise TypeError(
            "the blockwise backend reads a bias module's native form; a bias given as a tensor is already "
            "materialised (O(N^2)): use backend='reference' for it"
        )
    bias_scale = scale if convention == "seed" else 1.0
    delta = alignment.query_start - alignment.key_start
    if bias.offset_only:
        if values is None:
            values = bias.native(
                alignment.query_len, alignment.key_len, query_start=alignment.query_start,
                key_start=alignment.key_start, device=device,
            ).values
        return NativeSource(values, alignment.min_offset, delta, bias_scale, compute), [values], "native"
    params = [p for p in bias.parameters() if p.requires_grad]
    source = PairSource(bias, params, alignment.query_start, alignment.key_start, bias_scale, compute)
    return source, params, "pair"


class _BlockwiseFunction(torch.autograd.Function):
    """Inputs: query, key, value, the problem's settings, then the bias tensors (native values or parameters).

    Outputs (out, lse); both differentiable: since ``d lse_i / d s_ij = p_ij``, a gradient ``g_i`` of the
    lse enters the backward as ``D_i - g_i`` in place of ``D_i = dO_i . O_i``.
    """

    @staticmethod
    def forward(ctx, query, key, value, problem: TileProblem, kind: str, *bias_inputs):
        with flush_denormals_for(query):  # ALiBi's far keys: exp in float32 denormals, 1.5x slower at 4096
            out, lse = tiled_forward(problem)
        ctx.problem, ctx.kind = problem, kind
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.set_materialize_grads(False)
        return out.to(query.dtype), lse

    @staticmethod
    @first_order("blockwise")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        problem: TileProblem = ctx.problem
        problem.query, problem.key, problem.value = query, key, value
        source = problem.source
        if source is not None:  # fresh accumulators: a second backward (retain_graph) starts from zero
            if ctx.kind == "native":
                source.grad.zero_()
            else:
                source.grads = [torch.zeros_like(g) for g in source.grads]
        do = torch.zeros_like(out) if grad_out is None else grad_out.to(problem.compute)
        row_dot = (do * out).sum(dim=-1)  # D_i = dO_i . O_i
        if grad_lse is not None:
            row_dot = row_dot - grad_lse.to(problem.compute).masked_fill(lse == float("-inf"), 0.0)
        with flush_denormals_for(query):
            dq, dk, dv = tiled_backward(problem, do, lse, row_dot)
        if ctx.kind == "native":
            bias_grads = [source.native_grad()]
        elif ctx.kind == "pair":
            bias_grads = list(source.grads)
        else:
            bias_grads = []
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, *bias_grads)


class BlockwiseBackend(Backend):
    """Tiled attention in plain PyTorch: every bias module and mask, any device and dtype."""

    name = "blockwise"
    repeatable = True
    summary = "tiled attention in PyTorch (online softmax, recomputing backward): any device, dtype, bias module and mask; memory O(N·D)"

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        return tensor_bias_reasons(call) + tensor_position_reasons(call, "blockwise")

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        return small_block_reasons(call)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return blockwise_attention(call)


def blockwise_attention(
    call: AttentionCall, *, block_q: int | None = None, block_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Memory-efficient attention with a relative bias, tile by tile, on a validated call.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, Dv) -> out (B, H, Lq, Dv) in the dtype
    of ``query`` and lse (B, H, Lq) float32 (float64 for float64 inputs); formula and conventions as
    :func:`relbias.attention`. ``block_q`` / ``block_k``: tile sizes (tokens), default :data:`BLOCK_Q` /
    :data:`BLOCK_K`. Peak extra memory: a few (B, H, block_q, block_k) float32 tiles and O(B·H·L·D)
    accumulators.

    Raises:
        TypeError: the bias is a tensor (use the reference backend).
    """
    query, key, value, alignment = call.query, call.key, call.value, call.alignment
    compute = compute_dtype(query.dtype)
    windowed = call.window is not None and isinstance(call.bias, RelativeBias) and call.bias.offset_only
    values = call.native_bias().values if windowed else None  # offsets outside the window: not evaluated
    source, inputs, kind = make_source(call.bias, alignment, call.convention, call.scale, compute, query.device, values)
    careful = not call.hidden_keys_finite
    left, right = call.window or (None, None)
    problem = TileProblem(
        query, key, value, call.scale, source, call.mask, call.is_causal, call.delta,
        band_min_offset=None if right is None else -right, band_max_offset=left,
        block_q=block_q or (CAREFUL_BLOCK if careful else BLOCK_Q), block_k=block_k or (CAREFUL_BLOCK if careful else BLOCK_K),
        compute=compute, careful=careful, dropout=call.dropout,
    )
    return _BlockwiseFunction.apply(query, key, value, problem, kind, *inputs)
