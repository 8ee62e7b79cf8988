"""Halo attention: local attention over contiguous shards, exchanging only the keys the windows reach.

Forward: rank r posts, in one ``batch_isend_irecv``, the sends of its first and last keys (with their values and key
padding mask slices) to the ranks whose windows reach them and the receipt of its own halo (:mod:`.plan`); runs its
own block (its queries against its own keys) while they travel; then runs the queries that reach past the shard
against the left halo and against the right halo, and folds each block's ``(out, lse)`` into the result by
log-sum-exp (``relbias.distributed.merge``). A block runs exactly as a ring block does
(``relbias.distributed.ring.blocks.run_block``, at global positions, with the window), so the result is the
single-device one. Traffic per rank: at most ``left + right`` keys' keys, values and mask entries, however long the
sequence and however many ranks.

Backward (a custom ``torch.autograd.Function``): each halo block's share of the gradients
(``relbias.distributed.ring.blocks.block_backward``, with the merged output and lse) first; its dK and dV go back
to the ranks owning those keys in one exchange, overlapped with the own block's backward, and each rank adds what
its neighbours return for its keys. Bias-parameter gradients are summed over the group with one ``all_reduce``
(unless ``sync_bias_grads=False``). Saved for backward: the local q, k, v, the output, lse and the halo
(O((L/P + left + right) · D) per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...backends._shared.autograd import first_order
from ...backends._shared.dtypes import compute_dtype
from ..comm import all_reduce_sum
from ..apply import apply_strategy
from ..merge import DOUBLE_BACKWARD_HINT, merge_into
from ..ring.blocks import block_backward, run_block
from ..ring.plan import RingStats, block_kind
from ..validate import ContextParallelCall
from .exchange import post_halo, post_return
from .plan import HaloPart, HaloPlan, halo_plan, halo_reach

__all__ = ["halo_attention"]

_KV_TAG, _GRAD_TAG = 16, 24  # tags of the halo (k, v, mask) and of its dk/dv going home


@dataclass
class _Block:
    """A block of this rank's queries ``queries`` (starting at global ``query_start``) against keys at
    ``key_start``: its keys, values and mask slice, and where its key rows come from (``parts``)."""

    queries: slice
    query_start: int
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    key_start: int
    kind: str
    parts: tuple[HaloPart, ...] = ()


def _plan(call: ContextParallelCall) -> HaloPlan:
    reach = halo_reach(call.settings.window, call.settings.is_causal)
    return halo_plan(call.rank, call.world_size, call.local_len, reach)


def _kind(call: ContextParallelCall, q_start: int, q_len: int, k_start: int, k_len: int) -> str:
    s = call.settings
    return block_kind(q_start, q_len, k_start, k_len, is_causal=s.is_causal, far_distance=s.far_distance,
                      window=s.window)


def _own_block(call: ContextParallelCall, key, value) -> _Block:
    n, start = call.local_len, call.rank * call.local_len
    return _Block(slice(0, n), start, key, value, call.mask, start, _kind(call, start, n, start, n))


def _message(call: ContextParallelCall, key, value, rows: slice) -> list[torch.Tensor]:
    """The rows ``rows`` of this shard as they travel: key, value and (with a mask) the mask's slice."""
    return [key[:, :, rows], value[:, :, rows]] + ([] if call.mask is None else [call.mask[..., rows]])


def _exchange_halo(call: ContextParallelCall, plan: HaloPlan, key, value, stats: RingStats | None):
    """Post the halo exchange; its ``wait()`` gives each received part's key, value[, mask] (left parts, then
    right)."""
    return post_halo(plan, call.group, lambda rows: _message(call, key, value, rows), _KV_TAG,
                     f"the halo exchange (with ranks {_peers(plan)})", key.device, stats)


def _peers(plan: HaloPlan) -> list[int]:
    return sorted({p.peer for p in plan.left + plan.right + plan.to_next + plan.to_prev})


def _halo_blocks(call: ContextParallelCall, plan: HaloPlan, tensors: list[torch.Tensor]) -> list[_Block]:
    """The left and right halo blocks from the received tensors (per part: key, value[, mask])."""
    per = 3 if call.mask is not None else 2
    n, own = call.local_len, call.rank * call.local_len
    reach = dict(zip(("left", "right"), halo_reach(call.settings.window, call.settings.is_causal)))
    blocks, at = [], 0
    for side, parts in (("left", plan.left), ("right", plan.right)):
        if not parts:
            continue
        got = [tensors[per * (at + i): per * (at + i + 1)] for i in range(len(parts))]
        at += len(parts)
        key, value = (torch.cat([g[i] for g in got], dim=2) for i in (0, 1))
        mask = torch.cat([g[2] for g in got], dim=-1) if per == 3 else None
        # the queries whose windows reach past this side of the shard: its first `left`, or its last `right`
        count = min(n, reach[side])
        queries = slice(0, count) if side == "left" else slice(n - count, n)
        q_start, k_start = own + queries.start, parts[0].start
        kind = _kind(call, q_start, count, k_start, key.shape[2])
        blocks.append(_Block(queries, q_start, key, value, mask, k_start, kind, parts))
    return blocks


def _run(call, query, block: _Block, out, lse, stats: RingStats | None) -> None:
    if stats is not None:
        stats.add(block.kind)
    if block.kind == "skip":
        return
    qs = block.queries
    o, l = run_block(query[:, :, qs], block.key, block.value, block.mask, block.query_start, block.key_start,
                     block.kind, call.settings)
    merge_into(out[:, :, qs], lse[:, :, qs], o, l)


def halo_forward(call: ContextParallelCall, query, key, value, stats: RingStats | None):
    """(out (B, H, L/P, Dv) in the compute dtype, lse (B, H, L/P), the halo blocks) of this rank's queries."""
    plan = _plan(call)
    pending = _exchange_halo(call, plan, key, value, stats)
    b, h, lq, _ = query.shape
    compute = compute_dtype(query.dtype)
    out = torch.zeros(b, h, lq, value.shape[-1], dtype=compute, device=query.device)
    lse = torch.full((b, h, lq), float("-inf"), dtype=compute, device=query.device)
    _run(call, query, _own_block(call, key, value), out, lse, stats)  # while the halo travels
    halo = _halo_blocks(call, plan, pending.wait())
    for block in halo:
        _run(call, query, block, out, lse, stats)
    return out, lse, halo


def _backward_block(call, query, block: _Block, out, lse, grad_out, params, dq, dparams):
    """Add the block's dq and bias-parameter shares in place; return its (dk, dv) (zeros for a skipped block)."""
    if block.kind == "skip":
        return torch.zeros(block.key.shape, dtype=out.dtype, device=out.device), torch.zeros(
            block.value.shape, dtype=out.dtype, device=out.device)
    qs = block.queries
    gq, gk, gv, gp = block_backward(
        query[:, :, qs], block.key, block.value, block.mask, block.query_start, block.key_start, block.kind,
        call.settings, grad_out[:, :, qs], out[:, :, qs], lse[:, :, qs], params,
    )
    dq[:, :, qs] += gq
    for acc, g in zip(dparams, gp):
        if g is not None:
            acc += g
    return gk, gv


def halo_backward(call: ContextParallelCall, query, key, value, out, lse, halo: list[_Block], grad_out, params,
                  stats: RingStats | None):
    """(dq, dk, dv in the compute dtype, bias-parameter gradients: summed over the group, or this rank's part when
    ``call.sync_bias_grads`` is False)."""
    plan = _plan(call)
    grad_out = grad_out.to(out.dtype)
    dq = torch.zeros(query.shape, dtype=out.dtype, device=query.device)
    dparams = [torch.zeros_like(p) for p in params]
    grads = []  # per received part, left then right: its keys' and values' gradients
    for block in halo:  # first, so that their keys' gradients travel home during the own block's backward
        gk, gv = _backward_block(call, query, block, out, lse, grad_out, params, dq, dparams)
        at = 0
        for part in block.parts:
            grads.append([gk[:, :, at: at + part.length], gv[:, :, at: at + part.length]])
            at += part.length
    b, h = key.shape[:2]

    def like(part):  # the gradients of a lent part's keys and values, in the compute dtype
        return [((b, h, part.length, key.shape[-1]), out.dtype), ((b, h, part.length, value.shape[-1]), out.dtype)]

    pending = post_return(plan, call.group, grads, like, _GRAD_TAG,
                          f"the halo gradients' return (with ranks {_peers(plan)})", key.device, stats)
    dk, dv = _backward_block(call, query, _own_block(call, key, value), out, lse, grad_out, params, dq, dparams)
    got = pending.wait()
    for n, part in enumerate(plan.to_next + plan.to_prev):  # the parts of this shard other ranks saw
        dk[:, :, part.local] += got[2 * n]
        dv[:, :, part.local] += got[2 * n + 1]
    return dq, dk, dv, all_reduce_sum(dparams, call.group) if call.sync_bias_grads else dparams


class _HaloFunction(torch.autograd.Function):
    """Inputs: query, key, value, the validated call, stats, then the bias parameters that require grad."""

    @staticmethod
    def forward(ctx, query, key, value, call: ContextParallelCall, stats, *params):
        out, lse, halo = halo_forward(call, query, key, value, stats)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.halo = halo  # received in this call (not inputs): the halo blocks' backward reads them
        ctx.params, ctx.call, ctx.stats = params, call, stats
        return out.to(query.dtype, copy=True)  # not the saved tensor itself: the caller may change it in place

    @staticmethod
    @first_order("halo", subject="context-parallel attention (strategy 'halo')", instead=DOUBLE_BACKWARD_HINT)
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv, dparams = halo_backward(ctx.call, query, key, value, out, lse, ctx.halo, grad_out, ctx.params,
                                            ctx.stats)
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, *dparams)


def halo_attention(call: ContextParallelCall, query, key, value, stats: RingStats | None = None) -> torch.Tensor:
    """This rank's output shard (B, H, L/P, Dv) in the dtype of ``query``; differentiable (see the module docstring)."""
    return apply_strategy(_HaloFunction, halo_forward, call, query, key, value, stats)
