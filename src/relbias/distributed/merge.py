"""Merging partial attention results over disjoint key sets by their log-sum-exp.

Attention of one query over keys split into disjoint sets b = 1, 2, ... is, exactly (FlashAttention's
split-KV / Flash-Decoding, Dao et al. 2022, 2023; the ring step of Liu et al. 2023)::

    lse = logsumexp_b lse_b,   out = sum_b w_b out_b,   w_b = exp(lse_b - lse)

A row with no visible key in any set has ``lse = -inf`` and stays 0. The gradient of a loss with
output gradient ``dO`` reaches each part as (:func:`part_gradients`)::

    d out_b = w_b dO,   d lse_b = w_b (dO . out_b - dO . out) (+ w_b g when the merged lse has gradient g)

because ``d out / d lse_b = w_b (out_b - out)`` and ``d lse / d lse_b = w_b``.
"""

from __future__ import annotations

import torch

__all__ = ["DOUBLE_BACKWARD_HINT", "merge_into", "merge_partials", "part_gradients"]

#: Where to get the double backward (create_graph=True) that context-parallel attention, whose merged gradients are
#: computed once in closed form, does not have.
DOUBLE_BACKWARD_HINT = (
    "for create_graph=True gather the sequence and run single-device relbias.attention(..., backend='reference')"
)

_NEG_INF = float("-inf")


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a part into a running result, in place.

    Args:
        out: (..., Lq, Dv) running output, float32 or float64; updated.
        lse: (..., Lq) running log-sum-exp, same dtype; ``-inf`` where no key was seen yet; updated.
        part_out: (..., Lq, Dv) the part's output (any float dtype; 0 where it saw no key).
        part_lse: (..., Lq) the part's log-sum-exp, ``-inf`` where it saw no key.
    """
    new = torch.logaddexp(lse, part_lse.to(lse.dtype))
    safe = new.masked_fill(new == _NEG_INF, 0.0)  # rows with no key in either: both weights exp(-inf) = 0
    weight = torch.exp(part_lse.to(lse.dtype) - safe)[..., None]
    out.mul_(torch.exp(lse - safe)[..., None]).addcmul_(part_out.to(out.dtype), weight)  # no (Lq, Dv) temporary
    lse.copy_(new)


def merge_partials(
    out_1: torch.Tensor, lse_1: torch.Tensor, out_2: torch.Tensor, lse_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results over disjoint key sets: ``(out, lse)``, differentiable.

    Args:
        out_1, out_2: (B, H, Lq, Dv) outputs of attention over each key set.
        lse_1, lse_2: (B, H, Lq) their log-sum-exp (float32, or float64), ``-inf`` for a query with no
            visible key (as ``relbias.attention(..., return_lse=True)`` returns).

    Returns:
        out (B, H, Lq, Dv) in the dtype of ``out_1``, lse (B, H, Lq) in the dtype of ``lse_1``:
        ``m = logaddexp(lse_1, lse_2)``, ``out = out_1·exp(lse_1 - m) + out_2·exp(lse_2 - m)``; a row with
        ``m = -inf`` is 0.
    """
    m = torch.logaddexp(lse_1, lse_2.to(lse_1.dtype))
    safe = m.masked_fill(m == _NEG_INF, 0.0)
    w_1 = torch.exp(lse_1 - safe)[..., None]
    w_2 = torch.exp(lse_2.to(lse_1.dtype) - safe)[..., None]
    compute = lse_1.dtype
    out = out_1.to(compute) * w_1 + out_2.to(compute) * w_2
    return out.to(out_1.dtype), m


def part_gradients(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients that reach one part of a merged result (module docstring for the formula).

    Args:
        grad_out: (B, H, Lq, Dv) gradient of the merged output, float32/float64.
        out: (B, H, Lq, Dv) the merged output, same dtype.
        lse: (B, H, Lq) the merged log-sum-exp.
        part_out: (B, H, Lq, Dv) the part's output; part_lse: (B, H, Lq) its log-sum-exp.

    Returns:
        (grad_part_out (B, H, Lq, Dv), grad_part_lse (B, H, Lq)) in the dtype of ``grad_out``; 0 on rows the
        part does not see (``part_lse = -inf``).
    """
    compute = grad_out.dtype
    part_lse = part_lse.to(compute)
    weight = torch.exp(part_lse - lse.to(compute)).masked_fill(part_lse == _NEG_INF, 0.0)
    row_dot = (grad_out * out.to(compute)).sum(-1)
    part_dot = (grad_out * part_out.to(compute)).sum(-1)
    return grad_out * weight[..., None], weight * (part_dot - row_dot)
