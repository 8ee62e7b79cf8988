"""One ring block on one rank: single-device attention of a query piece against a key piece, at their global
positions, and its share of the backward pass.

A block of kind "bias" runs ``relbias.attention(..., query_start=, key_start=, return_lse=True)`` with the bias;
a block of kind "past" / "future" (every offset beyond a far-constant bias's distance T, see
:mod:`relbias.distributed.ring.plan`) runs bias-free fused attention (:mod:`relbias.distributed.ring.fused`) and adds the bias's per-head constant
``c_h = bias_scale · PE_h(±T)`` to its log-sum-exp: a constant added to every score of a key set is absorbed
into that set's log-sum-exp and leaves its softmax unchanged (the structured backend's identity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...backends import BACKENDS
from ...backends.toeplitz import toeplitz_attention, toeplitz_part_backward
from ...biases.base import RelativeBias
from ..._dropout import Dropout
from ...call import make_call
from ...dispatch import pick_backend
from .fused import bias_free_attention, far_block_backward, fused_runs
from ..merge import part_gradients

__all__ = ["BlockSettings", "block_backward", "run_block"]


@dataclass(frozen=True)
class BlockSettings:
    """The per-call settings every block of a call shares (validated, resolved).

    Attributes:
        bias: None or a :class:`relbias.RelativeBias` (num_heads 1 or H).
        is_causal: hide keys with offset ``i - j < 0``.
        scale: multiplier of ``q . k`` (resolved for the convention).
        convention: "seed", "additive" or "t5" (resolved).
        far_distance: T of a far-constant bias, or None.
        window: None or the local-attention window ``(left, right)`` (:mod:`relbias.window`), validated.
        dropout_p: attention dropout's probability (0: none); dropout_seed: the seed every rank's blocks share
            (:mod:`relbias._dropout`: the mask is a hash of the seed and absolute positions, so each block draws the
            bits one process would).
    """

    bias: RelativeBias | None
    is_causal: bool
    scale: float
    convention: str
    far_distance: int | None
    window: tuple[int | None, int | None] | None = None
    dropout_p: float = 0.0
    dropout_seed: int | None = None

    @property
    def bias_scale(self) -> float:
        """The factor the convention applies to the bias: ``scale`` for "seed", else 1."""
        return self.scale if self.convention == "seed" else 1.0


def far_constant(settings: BlockSettings, kind: str, device: torch.device) -> torch.Tensor:
    """(Hb, 1) the constant a "past" (offset T) or "future" (offset -T) block adds to its log-sum-exp, scaled
    by the convention's bias scale; differentiable in the bias parameters."""
    offset = settings.far_distance if kind == "past" else -settings.far_distance
    values = settings.bias.offset_values(torch.tensor([offset], device=device))  # (Hb, 1)
    return values * settings.bias_scale


#: From this many scores (B·H·lq·lk) a block with a far-constant bias runs the structured backend where it can,
#: instead of what "auto" picks (the reference up to 2^20 scores with gradients): measured on one CPU thread, D = 64,
#: a causal T5 block with gradients, structured is 1.4x faster at 256 x 256 x 8 heads and 2.9x at 512 x 512 x 8.
PREFER_STRUCTURED_SCORES = 1 << 19


def _block_call(query, key, value, mask, query_start, key_start, settings: BlockSettings):
    """The block's validated :class:`relbias.call.AttentionCall` (with lse), its dropout at the shared seed."""
    call = make_call(
        query, key, value, bias=settings.bias, mask=mask, is_causal=settings.is_causal, scale=settings.scale,
        convention=settings.convention, query_start=query_start, key_start=key_start, return_lse=True,
        window=settings.window,
    )
    if settings.dropout_p:  # not drawn from this process's generator: the seed every rank agreed on
        call = call.replaced(dropout=Dropout(settings.dropout_p, settings.dropout_seed, query_start, key_start))
    return call


def _runs_on_toeplitz(call) -> bool:
    """Whether the toeplitz backend runs the block's call (an offset-only bias, no mask or a bool key padding mask,
    CPU): its backward then needs no recompute (:func:`relbias.backends.toeplitz.toeplitz_part_backward`)."""
    return "toeplitz" in BACKENDS and not BACKENDS["toeplitz"].unsupported_reasons(call)


def _toeplitz_call(query, key, value, mask, query_start, key_start, settings: BlockSettings):
    """The block's validated call when the toeplitz backend can run it (:func:`_runs_on_toeplitz`), else None."""
    if "toeplitz" not in BACKENDS:
        return None
    call = _block_call(query, key, value, mask, query_start, key_start, settings)
    return call if _runs_on_toeplitz(call) else None


def _band_backend(call, settings: BlockSettings) -> str:
    """"structured" for a large enough block with a far-constant bias that it can run, else "auto"."""
    b, h, lq, _ = call.query.shape
    if settings.far_distance is None or b * h * lq * call.key.shape[2] < PREFER_STRUCTURED_SCORES or "structured" not in BACKENDS:
        return "auto"
    return "auto" if BACKENDS["structured"].unsupported_reasons(call) else "structured"


def run_block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    query_start: int,
    key_start: int,
    kind: str,
    settings: BlockSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``(out (B, H, lq, Dv) in query's dtype, lse (B, H, lq) float32/float64)``.

    Args:
        query: (B, H, lq, D) queries at positions ``query_start ...``; key, value: (B, H, lk, D / Dv) at
            ``key_start ...``; mask: None or a bool key padding mask (B or 1, H or 1, 1, lk).
        kind: "bias", "past" or "future" (:func:`relbias.distributed.ring.plan.block_kind`; never "skip").
        settings: :class:`BlockSettings`.

    Differentiable in query, key, value and the bias parameters (the backend's forward, as ``relbias.attention``
    with ``return_lse`` runs it).
    """
    if kind == "bias":  # one validated call (its dropout at the shared seed), on toeplitz or the backend chosen
        call = _block_call(query, key, value, mask, query_start, key_start, settings)
        if _runs_on_toeplitz(call):
            return toeplitz_attention(call)
        return pick_backend(_band_backend(call, settings), call).forward(call)
    # Every key is visible to every query (past: offsets >= T >= 1; future: only without is_causal).
    out, lse = bias_free_attention(
        query, key, value, mask, scale=settings.scale, query_start=query_start, key_start=key_start
    )
    return out, lse + far_constant(settings, kind, query.device).to(lse.dtype)


def block_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    query_start: int,
    key_start: int,
    kind: str,
    settings: BlockSettings,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """One block's share of the gradients of a merged result.

    A far block on the fused CPU kernel runs the kernel's backward with the merged output and the global lse
    (:func:`relbias.distributed.ring.fused.far_block_backward`, no recompute), and so does a biased block that the
    toeplitz backend runs (an offset-only bias, with or without a key padding mask). Any other block's forward is
    rerun on detached copies of its inputs; the gradients reaching its
    ``(out_b, lse_b)`` from the merged output are ``w_b dO`` and ``w_b (dO . out_b - dO . out)``,
    ``w_b = exp(lse_b - lse)`` (:func:`relbias.distributed.merge.part_gradients`), and autograd carries them
    to the block's inputs.

    Args:
        query, key, value, mask, query_start, key_start, kind, settings: as :func:`run_block`.
        grad_out: (B, H, lq, Dv) gradient of the merged output (float32/float64).
        out: (B, H, lq, Dv) the merged output, lse (B, H, lq) the merged log-sum-exp (same dtype).
        params: the bias parameters to differentiate (those with ``requires_grad``).

    Returns:
        (dq (B, H, lq, D), dk (B, H, lk, D), dv (B, H, lk, Dv)) in the dtype of ``grad_out``, and one gradient
        per parameter (None where the block does not read it).
    """
    if kind != "bias" and fused_runs(query, key, value):  # a far block: the fused kernel's backward, no recompute
        with torch.enable_grad():
            const = far_constant(settings, kind, query.device)
        dq, dk, dv, dconst = far_block_backward(
            query, key, value, mask, settings.scale, grad_out, out, lse, const.detach().to(lse.dtype)
        )
        wanted = [p for p in params if p.requires_grad]
        grads = torch.autograd.grad(const, wanted, dconst.to(const.dtype), allow_unused=True) if wanted else ()
        return dq.to(grad_out.dtype), dk.to(grad_out.dtype), dv.to(grad_out.dtype), list(grads)
    call = _toeplitz_call(query, key, value, mask, query_start, key_start, settings) if kind == "bias" else None
    if call is not None:  # the merged output and lse give toeplitz's backward this block's share directly
        dq, dk, dv, values, dvalues = toeplitz_part_backward(call, grad_out, out, lse)
        wanted = [p for p in params if p.requires_grad]
        grads = torch.autograd.grad(values, wanted, dvalues.to(values.dtype), allow_unused=True) if (
            wanted and values.requires_grad) else [None] * len(params)
        return dq.to(grad_out.dtype), dk.to(grad_out.dtype), dv.to(grad_out.dtype), list(grads)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (query, key, value)]
        part_out, part_lse = run_block(*leaves, mask, query_start, key_start, kind, settings)
        grad_part_out, grad_part_lse = part_gradients(grad_out, out, lse, part_out.detach(), part_lse.detach())
        grads = torch.autograd.grad(
            (part_out, part_lse), leaves + list(params),
            (grad_part_out.to(part_out.dtype), grad_part_lse.to(part_lse.dtype)), allow_unused=True,
        )
    dq, dk, dv = (g.to(grad_out.dtype) if g is not None else torch.zeros_like(t, dtype=grad_out.dtype) for g, t in zip(grads[:3], leaves))
    return dq, dk, dv, list(grads[3:])
