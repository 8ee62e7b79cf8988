"""``gather_halo``: a contiguous shard with the neighbouring keys a window reaches, differentiable."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..groups import resolve_group
from .exchange import post_halo, post_return
from .plan import HaloPlan, halo_plan

__all__ = ["gather_halo"]

_TAG, _GRAD_TAG = 32, 40


def _shape(x: torch.Tensor, dim: int, length: int) -> torch.Size:
    return x.shape[:dim] + (length,) + x.shape[dim + 1:]


class _GatherHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: HaloPlan, group, dim: int):
        got = post_halo(plan, group, lambda rows: [x[(slice(None),) * dim + (rows,)]], _TAG, "the halo gather",
                        x.device).wait()
        left, right = got[: len(plan.left)], got[len(plan.left):]
        ctx.plan, ctx.group, ctx.dim = plan, group, dim
        return torch.cat([*left, x, *right], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        plan, dim = ctx.plan, ctx.dim
        own = grad.shape[dim] - plan.left_len - plan.right_len
        # the extended tensor is [left parts, own rows, right parts]; the parts' gradients go home
        pieces = grad.split([p.length for p in plan.left] + [own] + [p.length for p in plan.right], dim=dim)
        n = len(plan.left)
        grads = [[g] for g in pieces[:n] + pieces[n + 1:]]
        got = post_return(plan, ctx.group, grads, lambda p: [(_shape(grad, dim, p.length), grad.dtype)], _GRAD_TAG,
                          "the halo gather's gradients", grad.device).wait()
        dx = pieces[n].clone()
        for part, g in zip(plan.to_next + plan.to_prev, got):
            dx.narrow(dim, part.local.start, part.length).add_(g)
        return dx, None, None, None


def gather_halo(x: torch.Tensor, reach: tuple[int, int], *, group=None, dim: int = -2) -> tuple[torch.Tensor, int]:
    """This rank's contiguous shard of a sequence with the ``left`` positions before it and the ``right`` after it
    (those that exist), fetched from the ranks that hold them (point-to-point, :mod:`relbias.distributed.halo.plan`).

    Args:
        x: this rank's shard, the sequence along ``dim`` (L/P positions, the same on every rank), any dtype.
        reach: ``(left, right)``, ints >= 0 (tokens).
        group: the process group (or 1-D DeviceMesh) that shards the sequence in the contiguous layout; default the
            default group.
        dim: the sequence dimension (default -2, as in (B, H, L/P, D)).

    Returns:
        ``(extended, first)``: ``x`` with ``min(left, r·L/P)`` positions before it and ``min(right, L - (r+1)·L/P)``
        after it along ``dim``, and the global position of its first entry. Differentiable in ``x``: the
        gradients of the borrowed positions go back to the ranks that own them. Every rank must call it (and
        backward) with the same shapes.

    Raises:
        ValueError: a negative side of ``reach``.
    """
    left, right = reach
    if left < 0 or right < 0:
        raise ValueError(f"reach must be (left, right) of ints >= 0 (tokens), got {reach}")
    group = resolve_group(group)
    dim = dim % x.dim()
    rank, size, n = dist.get_rank(group), dist.get_world_size(group), x.shape[dim]
    plan = halo_plan(rank, size, n, (left, right))
    if size == 1:
        return x, 0
    return _GatherHalo.apply(x, plan, group, dim), rank * n - plan.left_len
