"""LongT5's encoder self-attention on context-parallel sequence shards (``patch_longt5(model, process_group=...)``).

Rank r of P holds the contiguous positions ``[r·n, (r+1)·n)`` of every sequence (n = N/P, a multiple of the local
block length ``r_l + 1`` and, with TGlobal, of ``global_block_size``). Each layer:

1. fetches the ``local_radius + 1`` keys and values on either side of its shard from its neighbours
   (:func:`relbias.distributed.gather_halo`, differentiable: their gradients go back to the owners) and
   runs :func:`relbias.attention` once over them with ``window=(r_l, r_l)`` at global positions;
2. with TGlobal, sums its own tokens' states per global block, sums those over the group (one ``all_reduce``,
   differentiable: backward sums the gradient likewise; (B, N/g, d_model): small) and runs the summary
   part as the one-process patch does, at its blocks' global positions; both parts merge by log-sum-exp;
3. gives padded positions transformers' values from their three blocks' slots, the neighbours' included (the same
   halo).

The whole sequence's padding mask, (B, N) bool, is all-gathered once per layer call (it decides the global blocks
and which keys are padding). The tables' gradients come back summed over the group (``sync_bias_grads=True``, as
:func:`relbias.distributed.context_parallel_attention` does) or as this rank's part.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..distributed.comm import all_gather_seq, exchange, sum_gradients
from ..distributed.halo.gather import gather_halo
from ..distributed.merge import merge_partials
from ..functional import attention
from .longt5_attention import _global_part, _key_mask, _padding_rows, _shared_bias

__all__ = ["check_shard_length", "sharded_encoder_forward"]


class _SumBlocks(torch.autograd.Function):
    """Sum over the group forward; backward sums the gradient over the group (each rank's summaries feed its own
    queries: the gradient of a rank's partial sums is every rank's gradient of the total)."""

    @staticmethod
    def forward(ctx, sums, group):
        import torch.distributed as dist

        ctx.group = group
        total = sums.contiguous().clone()
        with exchange(group, "the all-reduce of LongT5's global block sums"):
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return _SumBlocks.apply(grad.contiguous(), ctx.group), None


@contextlib.contextmanager
def _tables_summed(modules_and_names, group):
    """Within the block, each ``(module, name)`` parameter (one table, held by several modules) reads through
    :func:`relbias.distributed.comm.sum_gradients`: the same values, and a gradient summed over the group."""
    swapped = {}
    originals = []
    for module, name in modules_and_names:
        table = module._parameters[name]
        if id(table) not in swapped:
            swapped[id(table)] = sum_gradients(table, group, "the all-reduce of LongT5's table gradients")
        originals.append((module, name, table))
        module._parameters[name] = swapped[id(table)]
    try:
        yield
    finally:
        for module, name, table in originals:
            module._parameters[name] = table


def check_shard_length(module, length: int, world_size: int, transient_global: bool) -> None:
    """Refuse a shard length that cuts LongT5's blocks: local blocks of ``local_radius + 1`` tokens and, with
    TGlobal, global blocks of ``global_block_size`` must each lie on one rank.

    Raises:
        ValueError: naming the shard length, the block length and the sequence lengths that fit.
    """
    sizes = [("local block length (local_radius + 1)", module.block_len)]
    if transient_global:
        sizes.append(("global_block_size", module.global_block_size))
    both = math.lcm(*(size for _, size in sizes))
    for name, size in sizes:
        if length % size:
            raise ValueError(
                f"patch_longt5(process_group=...): each rank's shard of {length} tokens must be a multiple of the "
                f"{name} {size}, so that no block spans two ranks; pad the sequences to a multiple of "
                f"{both * world_size} tokens ({both} per rank, P = {world_size}) and mask the padding"
            )


def sharded_encoder_forward(module, patch, hidden_states, mask=None, position_bias=None, output_attentions=False):
    """Replacement of a LongT5 encoder layer's ``forward`` under ``patch_longt5(process_group=...)``.

    Args:
        module: the layer; patch: the :class:`relbias.integrations.longt5.LongT5Patch` (its ``parallel`` set).
        hidden_states: (B, n, d_model), this rank's shard of the layer-normed input.
        mask: what the stack hands the layer for the shard (module docstring of :mod:`relbias.integrations.longt5`).
        position_bias: ignored.

    Returns:
        ``(output (B, n, d_model), None)``.

    Raises:
        NotImplementedError: ``output_attentions=True``; attention dropout in training.
        ValueError: a shard length that cuts a block (:func:`check_shard_length`).
    """
    import torch.distributed as dist

    if output_attentions:
        raise NotImplementedError(
            "output_attentions=True is not supported under patch_longt5(process_group=...) (the weights would span "
            "every rank's keys)"
        )
    if module.training and float(module.dropout) > 0:
        raise NotImplementedError(
            "attention dropout is not supported under patch_longt5(process_group=...); set the model's dropout_rate "
            "to 0 or call model.eval()"
        )
    parallel = patch.parallel
    group = parallel.group
    b, n, _ = hidden_states.shape
    h, d = module.n_heads, module.key_value_proj_dim
    local = patch.kind == "local"
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_shard_length(module, n, size, not local)
    start, block = rank * n, module.block_len

    def heads(x):  # (B, n, H·D) -> (B, H, n, D)
        return x.view(b, n, h, d).transpose(1, 2)

    query, key, value = heads(module.q(hidden_states)), heads(module.k(hidden_states)), heads(module.v(hidden_states))
    real = _key_mask(module, mask, n, local)
    if real is None:
        real = torch.ones(b, n, dtype=torch.bool, device=hidden_states.device)
    full_real = all_gather_seq(real, group, dim=1)  # (B, N)
    padded = not bool(full_real.all())
    # the keys and values of the block on either side (the window reaches local_radius of them; padding rows all)
    kv, first = gather_halo(torch.stack([key, value]), (block, block), group=group, dim=3)
    key_ext, value_ext = kv.unbind(0)
    backend = {} if patch.backend is None else {"backend": patch.backend}
    tables = [(patch.local_bias, "weight"), (patch.first.relative_attention_bias, "weight")]
    if not local:
        tables += [(patch.global_bias, "weight"), (patch.first.global_relative_attention_bias, "weight")]
    summed = _tables_summed(tables, group) if parallel.sync_bias_grads else contextlib.nullcontext()
    with summed:
        bias = _shared_bias(patch.local_bias, patch.first.relative_attention_bias.weight)
        keep = full_real[:, None, None, first: first + key_ext.shape[2]] if padded else None
        call = dict(bias=bias, mask=keep, convention="t5", query_start=start, key_start=first,
                    window=(module.local_radius, module.local_radius), **backend)
        if local:
            out = attention(query, key_ext, value_ext, **call)
            side = segments = None
        else:
            out_local, lse_local = attention(query, key_ext, value_ext, return_lse=True, **call)
            out_global, lse_global, side, segments = _global_part(
                module, patch, hidden_states, query, full_real.to(hidden_states.dtype), 0.0, backend, start=start,
                reduce=lambda sums: _SumBlocks.apply(sums, group),
            )
            out, _ = merge_partials(out_local, lse_local, out_global, lse_global)
        if padded and not bool(real.all()):  # rows of padding: transformers' values, from the three blocks' slots
            before, after = start - first, first + key_ext.shape[2] - start - n  # halo lengths (0 at the ends)

            def slots(x):  # (B, H, block + n + block, D): zeros past the sequence's ends
                return nn.functional.pad(x, (0, 0, block - before, block - after))

            ones = torch.ones(b, block, dtype=torch.bool, device=real.device)
            e, i, rows = _padding_rows(
                module, patch, nn.functional.pad(query, (0, 0, block, block)), slots(key_ext), slots(value_ext),
                torch.cat([ones, real, ones], dim=1), side, segments,
            )
            out = out.transpose(1, 2).index_put((e, i - block), rows.to(out.dtype)).transpose(1, 2)
    out = module.o(out.transpose(1, 2).reshape(b, n, h * d))
    return out, None
