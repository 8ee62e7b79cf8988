"""``gather_sequence``: every rank's shard of a sequence joined into the full sequence, differentiably.

Cross-attention under context parallelism needs the whole memory on every rank: each rank projects its own shard
of the memory to keys and values and gathers everyone's with one ``torch.distributed.all_gather``. The backward
sums the gradient of the full tensor over the group (one ``all_reduce``, the same order of additions for a fixed
group size) and hands each rank its shard's part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather_seq
from .groups import resolve_group
from .layout import check_layout, shard, unshard

__all__ = ["gather_sequence"]


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather and unshard along ``dim``. Backward: the gradient summed over the group, sharded."""

    @staticmethod
    def forward(ctx, tensor, group, layout, dim):
        ctx.group, ctx.layout, ctx.dim = group, layout, dim
        return unshard(_all_gather(tensor, group), layout=layout, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        part = shard(total, dist.get_world_size(ctx.group), dist.get_rank(ctx.group), layout=ctx.layout, dim=ctx.dim)
        return part, None, None, None


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    local = tensor.contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return parts


def gather_sequence(
    tensor: torch.Tensor, *, dim: int = -2, group: object = None, layout: str = "contiguous"
) -> torch.Tensor:
    """The full sequence from every rank's shard: the inverse of :func:`relbias.distributed.shard`, collectively.

    Args:
        tensor: this rank's shard, length L/P along ``dim``, the same shape on every rank of ``group``.
        dim: the sequence dimension; default -2 ((B, H, L/P, D) keys or values).
        group: the process group or 1-D ``DeviceMesh`` (default the default group); ranks in group order.
        layout: the layout the sequence was sharded with, "contiguous" (default) or "zigzag".

    Returns:
        The full tensor, length L along ``dim``, positions in ascending order. Differentiable (floating
        point): the gradient of this rank's shard is the full tensor's gradient summed over the group, so every
        rank must run the backward when one does. Bool and integer tensors (masks) are gathered as they are.

    Raises:
        ValueError: an unknown layout; an odd shard length with "zigzag"; a DeviceMesh of more than one dimension.
        TypeError: a ``group`` that is not a process group, a DeviceMesh or None.
    """
    check_layout(layout)
    group = resolve_group(group)
    if dist.get_world_size(group) == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.is_floating_point() or tensor.is_complex():
        return _GatherSequence.apply(tensor, group, layout, dim)
    full = all_gather_seq(tensor, group, dim=dim)  # bool travels as uint8
    return unshard(list(full.chunk(dist.get_world_size(group), dim=dim)), layout=layout, dim=dim)
