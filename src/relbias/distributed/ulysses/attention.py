"""DeepSpeed-Ulysses: an all-to-all turns sequence shards into head shards, each rank attends over the whole
sequence for H/P heads, and a second all-to-all turns the result back (Jacobs et al. 2023, "DeepSpeed Ulysses:
System Optimizations for Enabling Training of Extreme Long Sequence Transformer Models", §3.1).

Rank r gets heads ``[r·H/P, (r+1)·H/P)`` and the bias restricted to them
(:func:`relbias.distributed.ulysses.heads.slice_heads`; a shared one-head bias stays whole); the gathered sequence is put
back in global order (zigzag shards are reordered), so single-device ``relbias.attention`` runs at positions
0 .. L-1 with any backend. The key padding mask shards are all-gathered.

Backward (a custom ``torch.autograd.Function``): the output gradient travels the inverse all-to-all, autograd
runs through the single-device attention kept from forward (its backends save O(L · H/P · D)), dq, dk, dv travel
back, and the bias-parameter gradients (partial: this rank's heads) are summed over the group with one
``all_reduce`` (unless ``sync_bias_grads=False``). Every rank must call backward.
"""

from __future__ import annotations

import torch

from ...backends._shared.autograd import first_order
from ...functional import attention
from ..comm import all_gather_seq, all_reduce_sum, all_to_all_dim0
from .heads import slice_heads
from ..layout import layout_order
from ..merge import DOUBLE_BACKWARD_HINT
from ..validate import ContextParallelCall

__all__ = ["ulysses_attention"]


class _Resharder:
    """Sequence shards (B, H, L/P, D) <-> head shards (B, H/P, L, D), positions in global order."""

    def __init__(self, call: ContextParallelCall, device: torch.device) -> None:
        self.call, self.p = call, call.world_size
        self.order = None  # layout order -> global order, for zigzag
        if call.layout != "contiguous":
            self.order = layout_order(call.seq_len, self.p, call.layout, device)  # global position of each row
            self.inverse = torch.argsort(self.order)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, d = x.shape
        pieces = x.reshape(b, self.p, h // self.p, n, d).transpose(0, 1)  # (P, B, H/P, L/P, D): group j -> rank j
        got = all_to_all_dim0(pieces, self.call.group)  # got[i]: rank i's positions of this rank's heads
        full = got.permute(1, 2, 0, 3, 4).reshape(b, h // self.p, self.p * n, d)  # (B, H/P, L, D) layout order
        return full if self.order is None else full.index_select(2, self.inverse)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        b, hp, length, d = y.shape
        if self.order is not None:
            y = y.index_select(2, self.order)  # global -> layout order
        pieces = y.reshape(b, hp, self.p, length // self.p, d).permute(2, 0, 1, 3, 4)  # (P, B, H/P, L/P, D)
        got = all_to_all_dim0(pieces, self.call.group)  # got[j]: head group j of this rank's positions
        return got.transpose(0, 1).reshape(b, self.p * hp, length // self.p, d)

    def mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The full (Bm, Hm', 1, L) mask in global order from the local shards; a per-head mask sliced to this
        rank's heads."""
        if mask is None:
            return None
        full = all_gather_seq(mask, self.call.group, dim=-1)
        if self.order is not None:
            full = full.index_select(-1, self.inverse)
        if full.shape[1] > 1:
            hp = full.shape[1] // self.p
            full = full[:, self.call.rank * hp : (self.call.rank + 1) * hp]
        return full


def _local_attention(call: ContextParallelCall, query, key, value, mask) -> torch.Tensor:
    settings = call.settings
    hp = query.shape[1]
    bias = slice_heads(settings.bias, call.rank * hp, (call.rank + 1) * hp)
    return attention(
        query, key, value, bias=bias, mask=mask, is_causal=settings.is_causal, scale=settings.scale,
        convention=settings.convention, query_start=0, key_start=0, window=settings.window,
    )


class _UlyssesFunction(torch.autograd.Function):
    """Inputs: query, key, value, the validated call, then the bias parameters that require grad."""

    @staticmethod
    def forward(ctx, query, key, value, call: ContextParallelCall, *params):
        reshard = _Resharder(call, query.device)
        heads = [reshard.to_heads(t) for t in (query, key, value)]
        mask = reshard.mask(call.mask)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in heads]
            out = _local_attention(call, *leaves, mask)
        ctx.graph, ctx.reshard, ctx.call = (leaves, out), reshard, call
        ctx.params = params  # the module's own parameter objects, which the kept graph reads
        result = reshard.to_sequence(out.detach())
        return result if result._base is None else result.clone()  # a view cannot be changed in place

    @staticmethod
    @first_order("ulysses", subject="context-parallel attention (strategy 'ulysses')", instead=DOUBLE_BACKWARD_HINT)
    def backward(ctx, grad_out):
        params = list(ctx.params)
        leaves, out = ctx.graph
        del ctx.graph
        grad_heads = ctx.reshard.to_heads(grad_out.to(out.dtype))
        grads = torch.autograd.grad(out, leaves + params, grad_heads, allow_unused=True)
        dq, dk, dv = (ctx.reshard.to_sequence(g if g is not None else torch.zeros_like(t)) for g, t in zip(grads[:3], leaves))
        dparams = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads[3:], params)]
        if ctx.call.sync_bias_grads:
            dparams = all_reduce_sum(dparams, ctx.call.group)
        return (dq, dk, dv, None, *dparams)


def ulysses_attention(call: ContextParallelCall, query, key, value) -> torch.Tensor:
    """This rank's output shard (B, H, L/P, Dv) in the dtype of ``query``; differentiable (module docstring)."""
    bias = call.settings.bias
    params = [] if bias is None else [p for p in bias.parameters() if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in [query, key, value, *params])
    if not needs_grad:
        with torch.no_grad():
            reshard = _Resharder(call, query.device)
            out = _local_attention(call, *(reshard.to_heads(t) for t in (query, key, value)), reshard.mask(call.mask))
            return reshard.to_sequence(out)
    return _UlyssesFunction.apply(query, key, value, call, *params)
