"""The halo's two exchanges, for any tensors (:mod:`.attention`'s keys, values and mask; :mod:`.gather`'s one
tensor): lending a shard's edge rows to the ranks whose halos hold them, and the borrowed rows' gradients going back
to their owners."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import Pending, start_exchange
from .plan import HaloPart, HaloPlan

__all__ = ["post_halo", "post_return"]


def post_halo(plan: HaloPlan, group, rows: Callable[[slice], list[torch.Tensor]], tag: int, what: str,
              device: torch.device, stats=None) -> Pending:
    """Send this shard's rows that other ranks' halos hold and receive this rank's halo, asynchronously.

    Args:
        plan: this rank's :class:`relbias.distributed.halo.plan.HaloPlan`; group: its process group.
        rows: the tensors of some local rows as they travel (``rows(slice)``; a run of n rows is shaped like any
            other run of n rows).
        tag, what, device, stats: as :func:`relbias.distributed.comm.start_exchange`.

    Returns:
        A Pending whose ``wait()`` gives, per received part (``plan.left``, then ``plan.right``), its tensors.
    """
    sends = [(p.peer, rows(p.local)) for p in plan.to_next + plan.to_prev]
    receives = [(p.peer, [(t.shape, t.dtype) for t in rows(slice(0, p.length))]) for p in plan.left + plan.right]
    return start_exchange(group, sends, receives, tag, what, device, stats)


def post_return(plan: HaloPlan, group, grads: list[list[torch.Tensor]],
                like: Callable[[HaloPart], list[tuple[tuple, torch.dtype]]], tag: int, what: str,
                device: torch.device, stats=None) -> Pending:
    """The reverse of :func:`post_halo`, in backward: each received part's gradients go back to its owner.

    Args:
        grads: per received part (``plan.left``, then ``plan.right``), its tensors' gradients.
        like: ``(shape, dtype)`` of the gradients coming back for one of this shard's lent parts.
        plan, group, tag, what, device, stats: as :func:`post_halo`.

    Returns:
        A Pending whose ``wait()`` gives, per lent part (``plan.to_next``, then ``plan.to_prev``), its gradients.
    """
    sends = [(p.peer, g) for p, g in zip(plan.left + plan.right, grads, strict=True)]
    receives = [(p.peer, like(p)) for p in plan.to_next + plan.to_prev]
    return start_exchange(group, sends, receives, tag, what, device, stats, backward=True)
