"""The triton backend: fused attention with an offset-only bias on CUDA, forward and backward, in Triton.

The toeplitz design on a GPU. FlashAttention-2's tiles (Dao 2023, Alg. 1 and 2) read the bias of entry (i, j) from
the per-offset values of the bias's native form (:meth:`relbias.RelativeBias.native`: ``values[h, i - j + Lk - 1]``),
so no (Lq, Lk) tensor is formed, for every offset-only family (T5, per-offset, ALiBi, KERPLE, offset-only
``FunctionBias``). Kernels, one concept per module:

- :mod:`._forward`: the online-softmax forward, returning the output and the log-sum-exp (the seam context parallel
  and split-KV merges use); tiles outside the band of the causal rule and a local-attention window, and wholly padded
  key tiles, are skipped.
- :mod:`._backward`: dq, and dk with dv, in two kernels without atomics.
- :mod:`._bias_grad`: the bias-table gradient, summed along each tile's diagonals into one accumulator per (band of
  tiles, head) and folded on the host in a fixed order: deterministic, O(N) memory, no float atomics.
- :mod:`._tiles`: the scores of a tile and the dropout bits, the counter-based mask of :mod:`relbias._dropout` bit
  for bit, so for one seed the GPU drops exactly the entries the CPU kernels and the reference drop.

It takes causal and bidirectional calls, Lq != Lk with any query and key positions, a local-attention window
(:mod:`relbias.window`: every kernel visits only the tiles the band reaches and masks the entries outside it in the
tiles it cuts; the bias is evaluated only inside the band), a bool key padding mask (B or 1, H or 1, 1, Lk),
attention dropout, packed sequences (:func:`relbias.attention_varlen`: one launch, tiles never crossing a boundary,
a window applied per sequence), float32 (multiplied in full float32, not TF32), float16 and bfloat16 with float32
accumulation. Tiles hold :data:`BLOCK` rows on CUDA, :data:`INTERPRETED_BLOCK` under the interpreter.

Where it runs: on CUDA, ``auto`` takes it for every call it supports once :func:`._support.kernel_check` has
compared the compiled kernels with the reference on that device (a failed check is a refusal ``explain_backend``
shows, and the next backend runs). With ``TRITON_INTERPRET=1`` set before relbias loads the kernels, the Triton
interpreter runs them on CPU tensors: ``backend="triton"`` then accepts CPU float32 and float16 calls (the
interpreter has no bfloat16), slowly, to test the kernels without a GPU; ``auto`` never picks it on CPU. Under
torch.compile forward and backward are ``torch.library`` custom ops (:mod:`._function`), one graph node each; the
device check's verdict is a constant of the graph (taken when it is traced). Saved for backward: O(B·H·L·D).
"""

from __future__ import annotations

import torch

from ...call import AttentionCall
from .._shared.reasons import (
    empty_axis_reasons, non_finite_reasons, offset_kernel_reasons, tensor_bias_reasons, tensor_position_reasons,
)
from ..base import Backend
from ._support import traced_device_reason, traced_kernel_check

__all__ = ["BLOCK", "INTERPRETED_BLOCK", "TritonBackend", "triton_attention"]

#: Query and key rows per tile on CUDA (tokens).
BLOCK = 64
#: Query and key rows per tile under the Triton interpreter (tokens): small calls still span several tiles.
INTERPRETED_BLOCK = 16

_CUDA_ONLY = "auto takes triton on CUDA only (on CPU it runs only under the Triton interpreter, for testing)"


class TritonBackend(Backend):
    """Offset-only biases on CUDA: Triton FlashAttention-2 kernels reading the bias per offset."""

    name = "triton"
    repeatable = True
    summary = (
        "offset-only bias read from its per-offset values, no mask or a bool key padding mask, dropout and packed "
        "sequences inside the kernels: fused Triton FlashAttention-2 forward and backward with a deterministic bias "
        "gradient (CUDA; CPU tensors only under the Triton interpreter); memory O(N·D)"
    )

    def explain(self, call: AttentionCall) -> str:
        if call.query.device.type == "cpu":
            return f"{self.summary}; here it runs under the Triton interpreter (TRITON_INTERPRET=1), slowly, to test"
        return self.summary

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tensor_bias_reasons(call) + tensor_position_reasons(call, "triton")
        reasons += offset_kernel_reasons(call)
        reasons += empty_axis_reasons(call, "the Triton kernels")
        largest = max(call.query.numel(), call.key.numel(), call.value.numel())
        if largest >= 2**31:
            reasons.append(f"a tensor of {largest} elements: the Triton kernels index with 32-bit offsets (below 2^31)")
        d, dv = call.query.shape[-1], call.value.shape[-1]
        why_not = traced_device_reason(call.query.device, call.query.dtype, d, dv)
        if why_not:
            reasons.append(why_not)
        if reasons:
            return reasons
        if call.query.device.type == "cuda":
            failed = traced_kernel_check(call.query.device, call.query.dtype, d, dv)
            if failed:
                return [failed]
        return non_finite_reasons(call, "the Triton kernels")

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        if call.query.device.type != "cuda":
            return [_CUDA_ONLY]
        return []

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_attention(call)


def triton_attention(call: AttentionCall, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with an offset-only bias on a validated call that :class:`TritonBackend` accepts; the formula
    is :func:`relbias.attention`'s.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, Dv) on CUDA (or CPU under the interpreter)
    -> out (B, H, Lq, Dv) in the dtype of ``query`` and lse (B, H, Lq) float32, -inf (and out 0) for a query that
    sees no key; differentiable in query, key, value and the bias parameters. ``block``: rows per tile, a power of
    two >= 16 (default :data:`BLOCK`, :data:`INTERPRETED_BLOCK` under the interpreter).
    """
    from ._function import triton_apply

    plan = make_plan(call, block)
    padding = call.key_padding
    padding = None if padding is None else padding.to(torch.uint8)
    return triton_apply(call.query, call.key, call.value, call.native_bias().values, padding, plan)


def _seeds(seeds: list | None, dropout, device: torch.device) -> torch.Tensor | None:
    """The plan's seeds tensor, int32 on ``device``: each packed sequence's (ints, or 0-dim tensors drawn in a
    compiled graph), a batch call's seed drawn in a compiled graph as (1,), else None."""
    if seeds is not None:
        if any(isinstance(seed, torch.Tensor) for seed in seeds):
            return torch.stack([torch.as_tensor(seed, device=device) for seed in seeds]).to(torch.int32)
        return torch.tensor(seeds, dtype=torch.int32, device=device)
    if dropout is not None and isinstance(dropout.seed, torch.Tensor):
        return dropout.seed.reshape(1).to(device=device, dtype=torch.int32)
    return None


def make_plan(call: AttentionCall, block: int | None, *, cu_seqlens: torch.Tensor | None = None,
              seeds: list[int] | None = None, max_len: int = 0):
    """The kernels' :class:`._plan.Plan` for ``call`` (for packed sequences: ``call`` is the longest one's, with the
    boundaries ``cu_seqlens``, each sequence's dropout seed and the longest length)."""
    from ._plan import Plan

    device = call.query.device
    dropout = call.dropout
    if block is None:
        block = INTERPRETED_BLOCK if device.type == "cpu" else BLOCK
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    lo, hi = call.offset_band  # the causal rule and the window; a side that hides no entry here is left out
    a = call.alignment  # for packed sequences the longest one's: a shorter one holds a subset of its offsets
    lo = None if lo is None or lo <= a.min_offset else lo
    hi = None if hi is None or hi >= a.max_offset else hi
    return Plan(
        scale=float(call.scale), bias_scale=float(call.bias_scale), band=(lo, hi),
        delta=0 if cu_seqlens is not None else int(call.delta),
        query_pos=0 if dropout is None else int(dropout.query_start),
        key_pos=0 if dropout is None else int(dropout.key_start),
        dropout_p=0.0 if dropout is None else dropout.p,
        seeds=_seeds(seeds, dropout, device),
        batch_seed=0 if dropout is None or isinstance(dropout.seed, torch.Tensor) else int(dropout.seed),
        cu_seqlens=cu_seqlens, max_len=max_len, block=block,
    )
