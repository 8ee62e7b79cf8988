"""The torch.distributed operations context-parallel attention uses: ring neighbours (and halo peers) exchanging
tensors with batched point-to-point ops, an equal-split all-to-all, an all-gather, and a sum of gradients over the group.

No transport of our own: everything goes through ``torch.distributed`` (its process groups, ``P2POp`` /
``batch_isend_irecv``, ``all_to_all_single``, ``all_gather``, ``all_reduce``). Every tensor sent is made
contiguous; bool tensors travel as uint8.

A rank that raises or stops in the middle of a call leaves the others waiting for its messages; each wait ends at
the process group's timeout (``init_process_group(timeout=...)``) or when the transport sees the peer gone, and the
transport's error comes back as a RuntimeError that says which exchange of which rank failed and why that happens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["Pending", "RingChannel", "all_gather_seq", "all_reduce_sum", "all_to_all_dim0", "exchange", "nbytes",
           "start_exchange", "sum_gradients"]


@contextlib.contextmanager
def exchange(group: dist.ProcessGroup | None, what: str):
    """Run communication of ``group``; a RuntimeError from it (a timeout, a closed connection) is raised again as
    one naming this rank, ``what`` was exchanged, and the likely cause, chained to the transport's error."""
    try:
        yield
    except RuntimeError as error:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        raise RuntimeError(
            f"context-parallel attention, rank {rank} of {size}: {what} did not complete ({error}); another rank "
            f"of the group most likely raised or stopped during this call (its own error says why): every rank must "
            f"make the same calls, forward and backward"
        ) from error


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the tensors occupy as they travel (bool as uint8, one byte per element)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class Pending:
    """Tensors in flight: :meth:`wait` finishes the exchange and returns the received tensors."""

    def __init__(self, works: list, received: list[torch.Tensor], sent: list[torch.Tensor], bools: list[bool],
                 group: dist.ProcessGroup | None, what: str) -> None:
        self._works, self._received, self._sent, self._bools = works, received, sent, bools
        self._group, self._what = group, what

    def wait(self) -> list[torch.Tensor]:
        with exchange(self._group, self._what):
            for work in self._works:
                work.wait()
        received, self._received = self._received, []
        # the send buffers may be freed once the sends completed: the works hold them too (gloo's do), so both go;
        # kept until the Pending itself is dropped, a ring step's sent dK and dV (two shard-sized tensors) outlived
        # the next step's compute
        self._works, self._sent = [], []
        return [t.bool() if b else t for t, b in zip(received, self._bools)]


def start_exchange(
    group: dist.ProcessGroup | None,
    sends: list[tuple[int, list[torch.Tensor]]],
    receives: list[tuple[int, list[tuple[torch.Size, torch.dtype]]]],
    tag: int,
    what: str,
    device: torch.device,
    stats=None,
    backward: bool = False,
) -> Pending:
    """Post point-to-point sends and receives together (``torch.distributed.batch_isend_irecv``), asynchronously.

    Args:
        group: the process group (None: the default group); peers are ranks in it.
        sends: ``(peer, tensors)`` to send; tensor n of each uses tag ``tag + n``.
        receives: ``(peer, [(shape, dtype), ...])``: receive tensors of those shapes and dtypes from ``peer``, tensor
            n with tag ``tag + n``.
        tag: the first tag; what: the exchange, as an error names it; device: where received tensors are put.
        stats: None, or a :class:`relbias.distributed.RingStats` that counts the bytes sent and received (of
            backward when ``backward``).

    Returns:
        A :class:`Pending` whose ``wait()`` gives the received tensors, in the order of ``receives``, flattened.
        Bool tensors travel as uint8 and come back bool.
    """
    ops, sent, received, bools = [], [], [], []
    for peer, tensors in sends:
        for n, t in enumerate(tensors):
            buffer = (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()
            sent.append(buffer)
            ops.append(dist.P2POp(dist.isend, buffer, group=group, tag=tag + n, group_peer=peer))
    for peer, specs in receives:
        for n, (shape, dtype) in enumerate(specs):
            bools.append(dtype == torch.bool)
            buffer = torch.empty(shape, dtype=torch.uint8 if bools[-1] else dtype, device=device)
            received.append(buffer)
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, tag=tag + n, group_peer=peer))
    works = []
    if ops:
        with exchange(group, f"posting {what}"):
            works = dist.batch_isend_irecv(ops)
    if stats is not None:
        stats.add_traffic(nbytes(sent), nbytes(received), backward=backward)
    return Pending(works, received, sent, bools, group, what)


class RingChannel:
    """This rank's neighbours in a ring over ``group`` (None: the default group): it sends to rank + 1 and
    receives from rank - 1 (ranks of the group, modulo its size)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size

    def start(self, tensors: list[torch.Tensor], tag: int, stats=None, backward: bool = False) -> Pending:
        """Send ``tensors`` to the next rank and receive as many (same shapes and dtypes) from the previous one,
        asynchronously (``torch.distributed.batch_isend_irecv``); tensor n uses tag ``tag + n``; ``stats`` and
        ``backward`` as :func:`start_exchange`.

        Every rank of the group must call it with the same shapes, in the same order.
        """
        what = f"the ring exchange (sending to rank {self.next}, receiving from rank {self.prev})"
        specs = [(t.shape, t.dtype) for t in tensors]
        return start_exchange(self.group, [(self.next, tensors)], [(self.prev, specs)], tag, what, tensors[0].device,
                              stats, backward)


def all_to_all_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Equal-split all-to-all along dimension 0: ``tensor`` (P, ...) -> (P, ...), piece i of rank j becomes
    piece j of rank i (``torch.distributed.all_to_all_single``). Its own inverse."""
    out = torch.empty_like(tensor.contiguous())
    with exchange(group, "an all-to-all"):
        dist.all_to_all_single(out, tensor.contiguous(), group=group)
    return out


def all_gather_seq(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (``torch.distributed.all_gather``); bool
    travels as uint8."""
    is_bool = tensor.dtype == torch.bool
    local = (tensor.to(torch.uint8) if is_bool else tensor).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    with exchange(group, "an all-gather"):
        dist.all_gather(parts, local, group=group)
    full = torch.cat(parts, dim=dim)
    return full.bool() if is_bool else full


def all_reduce_sum(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The sum over the group of each tensor (one flattened ``all_reduce``; the same order of additions for a
    fixed group size, so the result is deterministic)."""
    if not tensors or dist.get_world_size(group) == 1:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    with exchange(group, "the all-reduce of the bias gradients"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view_as(t).to(t.dtype))
        at += t.numel()
    return out


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over the group (one ``all_reduce``)."""

    @staticmethod
    def forward(ctx, tensor, group, what):
        ctx.group, ctx.what = group, what
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        with exchange(ctx.group, ctx.what):
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None, None


def sum_gradients(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str = "a gradients' all-reduce"):
    """``tensor`` itself (a copy) whose gradient, in backward, is summed over ``group``: each rank's part of a
    quantity every rank computes from a replicated parameter (bias values of this rank's heads, block sums of this
    rank's tokens) becomes the whole gradient on every rank. Every rank of the group must run the backward through
    it, with the same shape. ``what``: the exchange, as an error names it."""
    if dist.get_world_size(group) == 1:
        return tensor
    return _SumGradients.apply(tensor, group, what)
