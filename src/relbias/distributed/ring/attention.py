"""Ring attention: keys and values rotate around the ring; each rank merges its blocks by log-sum-exp.

Forward (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3): a rank's keys and values travel in
``kv_chunks`` chunks C (:func:`relbias.distributed.ring.plan.kv_chunks_of`; C = 1: the whole shard), one full rotation
of the ring per chunk. At step s = 0 .. P-1 of a rotation, rank r holds that chunk of rank (r - s) mod P
together with its piece starts (global positions) and its key padding mask slice; it posts the exchange of that
block to rank r + 1 (and the receipt of the next one from r - 1), runs its blocks (one per pair of local query
piece and travelling key piece, see :mod:`relbias.distributed.ring.plan`) while the exchange is in flight, and folds
each block's ``(out, lse)`` into its running result (:mod:`relbias.distributed.merge`). Chunks bound what a rank
holds in flight to 1/C of a shard's keys and values (the one it computes with and the one it receives), for C
times as many messages, each 1/C the size.

Backward (a custom ``torch.autograd.Function``): the same rotations once more; per block, its share of the
merged result's gradient (:func:`relbias.distributed.ring.blocks.block_backward`): a far block, and a biased block the
toeplitz backend runs, get their kernel's backward with the merged output and global lse; any other block is
recomputed with autograd and the share pushed through it. dq stays; dk and dv of the travelling chunk are added
to the accumulators that travel with it, so after P hops they reach the rank that owns those keys. Each hop is
posted after the block's compute and waited for before the next step's compute, which then adds into the
received accumulators in place: a rank holds one pair of them at a time (waiting after the compute, to overlap
the hop, would hold three: those in flight each way and this step's). Bias-parameter gradients are partial
per rank and summed over the group with one ``all_reduce`` (unless ``sync_bias_grads=False``). Every rank must call backward. Saved for
backward: the local q, k, v, mask shard, the merged output and lse (O(L/P · D) per rank).
"""

from __future__ import annotations

import torch

from ...backends._shared.autograd import first_order
from ...backends._shared.dtypes import compute_dtype
from .blocks import block_backward, run_block
from ..comm import RingChannel, all_reduce_sum
from ..layout import shard_pieces
from ..apply import apply_strategy
from ..merge import DOUBLE_BACKWARD_HINT, merge_into
from .plan import RingStats, block_kind, kv_chunks_of
from ..validate import ContextParallelCall

__all__ = ["ring_attention"]

_KV_TAG, _GRAD_TAG = 0, 8  # tags of the block exchange (k, v, starts, mask) and of the dk/dv exchange


def _blocks(call: ContextParallelCall, starts: torch.Tensor, key_len: int):
    """(local query slice, query start, travelling key slice, key start, kind) of each block against a travelling
    chunk of ``key_len`` keys whose pieces start at ``starts`` (int64, one per piece, equal lengths)."""
    settings = call.settings
    queries = shard_pieces(call.seq_len, call.world_size, call.rank, call.layout)
    starts = starts.tolist()
    piece = key_len // len(starts)
    at = 0
    for q_start, q_len in queries:
        q_slice = slice(at, at + q_len)
        at += q_len
        for n, k_start in enumerate(starts):
            kind = block_kind(q_start, q_len, k_start, piece, is_causal=settings.is_causal,
                              far_distance=settings.far_distance, window=settings.window)
            yield q_slice, q_start, slice(n * piece, (n + 1) * piece), k_start, kind


def _own_chunks(call: ContextParallelCall, key, value):
    """(local key slice, travelling block) of each of this rank's ``kv_chunks`` chunks, in the order they travel: the
    block is [key, value, piece starts (int64), and the mask's slice when there is a mask]."""
    pieces = shard_pieces(call.seq_len, call.world_size, call.rank, call.layout)
    for keys, starts in kv_chunks_of(pieces, call.kv_chunks):
        block = [key[:, :, keys], value[:, :, keys], torch.tensor(starts, dtype=torch.int64, device=key.device)]
        yield keys, block + ([] if call.mask is None else [call.mask[..., keys]])


def _mask_slice(mask, keys: slice):
    return None if mask is None else mask[..., keys]


def ring_forward(call: ContextParallelCall, query, key, value, stats: RingStats | None):
    """(out (B, H, L/P, Dv) in the compute dtype, lse (B, H, L/P)) of this rank's queries over the whole ring."""
    channel = RingChannel(call.group) if call.world_size > 1 else None
    compute = compute_dtype(query.dtype)
    b, h, lq, _ = query.shape
    out = torch.zeros(b, h, lq, value.shape[-1], dtype=compute, device=query.device)
    lse = torch.full((b, h, lq), float("-inf"), dtype=compute, device=query.device)
    for _, block in _own_chunks(call, key, value):  # one rotation of the ring per chunk
        for step in range(call.world_size):
            pending = channel.start(block, _KV_TAG, stats) if step < call.world_size - 1 else None
            k, v, starts = block[:3]
            mask = block[3] if len(block) > 3 else None
            for qs, q_start, ks, k_start, kind in _blocks(call, starts, k.shape[2]):
                if stats is not None:
                    stats.add(kind)
                if kind == "skip":
                    continue
                o, l = run_block(query[:, :, qs], k[:, :, ks], v[:, :, ks], _mask_slice(mask, ks), q_start, k_start, kind, call.settings)
                merge_into(out[:, :, qs], lse[:, :, qs], o, l)
            if pending is not None:
                block = pending.wait()
    return out, lse


def ring_backward(call: ContextParallelCall, query, key, value, out, lse, grad_out, params, stats=None):
    """(dq, dk, dv in the compute dtype, bias-parameter gradients: summed over the group, or this rank's part when
    ``call.sync_bias_grads`` is False)."""
    compute = out.dtype
    grad_out = grad_out.to(compute)
    dq = torch.zeros(query.shape, dtype=compute, device=query.device)
    dparams = [torch.zeros_like(p) for p in params]
    if call.kv_chunks == 1:  # the whole shard's sums come home at once: they are dk and dv
        (_, block), = _own_chunks(call, key, value)
        dk, dv = _rotate_backward(call, query, block, out, lse, grad_out, params, dq, dparams, stats)
    else:  # each chunk's sums come home after its rotation, into their rows
        dk = torch.empty(key.shape, dtype=compute, device=key.device)
        dv = torch.empty(value.shape, dtype=compute, device=value.device)
        for keys, block in _own_chunks(call, key, value):
            dk_chunk, dv_chunk = _rotate_backward(call, query, block, out, lse, grad_out, params, dq, dparams, stats)
            dk[:, :, keys] = dk_chunk
            dv[:, :, keys] = dv_chunk
    return dq, dk, dv, all_reduce_sum(dparams, call.group) if call.sync_bias_grads else dparams


def _rotate_backward(call: ContextParallelCall, query, block, out, lse, grad_out, params, dq, dparams, stats):
    """One rotation of the backward ring for this rank's travelling ``block`` (one chunk): adds every block's dq
    and bias-parameter shares into ``dq`` and ``dparams`` in place; returns the chunk's (dk, dv), every rank's
    share summed."""
    channel = RingChannel(call.group) if call.world_size > 1 else None
    compute = out.dtype
    grads_pending = None
    for step in range(call.world_size):
        pending = channel.start(block, _KV_TAG, stats, backward=True) if step < call.world_size - 1 else None
        k, v, starts = block[:3]
        mask = block[3] if len(block) > 3 else None
        if grads_pending is not None:  # what the ranks before this one added for this block: this rank adds to it
            dk, dv = grads_pending.wait()  # (and the previous block's sums, sent to the next rank, are freed)
        else:
            dk = torch.zeros(k.shape, dtype=compute, device=k.device)
            dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        for qs, q_start, ks, k_start, kind in _blocks(call, starts, k.shape[2]):
            if kind == "skip":
                continue
            gq, gk, gv, gp = block_backward(
                query[:, :, qs], k[:, :, ks], v[:, :, ks], _mask_slice(mask, ks), q_start, k_start, kind, call.settings,
                grad_out[:, :, qs], out[:, :, qs], lse[:, :, qs], params,
            )
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
            for acc, g in zip(dparams, gp):
                if g is not None:
                    acc += g
        if channel is not None:
            grads_pending = channel.start([dk, dv], _GRAD_TAG, stats, backward=True)
        if pending is not None:
            block = pending.wait()
    if grads_pending is not None:  # after P hops: this rank's own keys, with every rank's share
        dk, dv = grads_pending.wait()
    return dk, dv


class _RingFunction(torch.autograd.Function):
    """Inputs: query, key, value, the validated call, stats, then the bias parameters that require grad."""

    @staticmethod
    def forward(ctx, query, key, value, call: ContextParallelCall, stats, *params):
        out, lse = ring_forward(call, query, key, value, stats)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.params = params  # the module's own parameter objects: the recomputed blocks read these
        ctx.call, ctx.stats = call, stats
        return out.to(query.dtype, copy=True)  # not the saved tensor itself: the caller may change it in place

    @staticmethod
    @first_order("ring", subject="context-parallel attention (strategy 'ring')", instead=DOUBLE_BACKWARD_HINT)
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        params = ctx.params
        dq, dk, dv, dparams = ring_backward(ctx.call, query, key, value, out, lse, grad_out, params, ctx.stats)
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, *dparams)


def ring_attention(call: ContextParallelCall, query, key, value, stats: RingStats | None = None) -> torch.Tensor:
    """This rank's output shard (B, H, L/P, Dv) in the dtype of ``query``; differentiable (see the module docstring)."""
    return apply_strategy(_RingFunction, ring_forward, call, query, key, value, stats)
