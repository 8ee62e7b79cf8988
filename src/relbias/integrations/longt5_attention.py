"""The pieces of a patched LongT5 encoder layer's attention that the one-process forward
(:mod:`relbias.integrations.longt5`) and the context-parallel one (:mod:`relbias.integrations.longt5_parallel`)
share: the key padding mask from transformers' masks, transient-global attention over the block summaries, and
transformers' values for padded rows (Guo et al. 2022, "LongT5", §3.1; the module docstring of
:mod:`relbias.integrations.longt5` says what each computes)."""

from __future__ import annotations

import torch
from torch import nn

from ..biases.t5 import T5Bias
from ..functional import attention

__all__ = []


def _shared_bias(bias: T5Bias, table: nn.Parameter) -> T5Bias:
    """``bias``, reading ``table`` (the model's parameter, replaced e.g. by ``load_state_dict(assign=True)``)."""
    if bias.weight is not table:
        bias.weight = table
    return bias


def _key_mask(module: nn.Module, mask: torch.Tensor | None, length: int, local: bool) -> torch.Tensor | None:
    """(B, N) bool, True for a real token, from the mask transformers hands the layer: local attention's
    (B, 1, num_blocks, r + 1, 3 (r + 1)) block mask (its diagonal of the centre block), TGlobal's (B, N) mask."""
    if mask is None:
        return None
    if local:
        block = module.block_len
        centre = mask[:, 0, :, :, block: 2 * block]  # (B, num_blocks, r + 1, r + 1)
        return torch.diagonal(centre, dim1=-2, dim2=-1).reshape(mask.shape[0], -1)[:, :length] > 0
    return mask != 0


def _padding_rows(module, patch, query, key, value, real, side=None, segments=None):
    """``(e, i, out)``: the rows of padding (``~real``, (B, N) bool: batch row ``e`` and position ``i``, (n',) each, in
    ``nonzero`` order) and their outputs (n', H, D) as transformers computes them: every score of such a row is
    ``-1e10`` plus a finite term, so its weights are uniform over the row's slots: its three blocks' ``S =
    3 (r + 1)`` slots (zero keys and values past the sequence's ends) and, with TGlobal, every summary. Without
    gradients, that is the mean of those slots' values, from per-block sums: O(N·D). With gradients, each block
    holding padding is scored against its slots as transformers does, and the rows take ``softmax(s - s.detach())
    v`` (the same values, and softmax's gradient at uniform weights, which reaches queries, keys and both tables):
    O(n'·(S + N / g)·D). With TGlobal, a sequence with summaries of empty blocks gives its padding 0 (those
    summaries are the only keys it sees; their values are 0)."""
    block = module.block_len
    b, h, n, d = query.shape
    blocks = -(-n // block)
    fill = blocks * block - n
    padding = nn.functional.pad(~real, (0, fill)).view(b, blocks, block)  # positions past the end are no rows

    def by_block(x):  # (B, H, N, D) -> (B, H, blocks + 2, r + 1, D): a block of zero slots at either end
        return nn.functional.pad(x, (0, 0, block, block + fill)).view(b, h, blocks + 2, block, d)

    tables = [patch.first.relative_attention_bias.weight]
    if side is not None:
        tables.append(patch.first.global_relative_attention_bias.weight)
    if torch.is_grad_enabled() and any(x.requires_grad for x in [query, key, value, *tables, *(side or ())]):
        e, c = padding.any(-1).nonzero(as_tuple=True)  # the m blocks holding padding
        three = c[:, None] + torch.arange(3, device=c.device)  # their slots' blocks c - 1 .. c + 1 (shifted by one)

        def slots(x):  # (m, H, S, D)
            return by_block(x)[e[:, None], :, three].transpose(1, 2).reshape(len(e), h, 3 * block, d)

        rows = by_block(query)[e, :, c + 1]  # (m, H, r + 1, D)
        scores = rows @ slots(key).transpose(-1, -2) + patch.first.compute_bias(block)[0]  # (m, H, r + 1, S)
        values = slots(value)
        if side is not None and side[0].shape[2]:  # no summary below one global block: the side table gets no grad
            side_key, side_value = side[0][e], side[1][e]  # (m, H, G, D)
            distance = torch.arange(side_key.shape[2], device=c.device) + 1  # block id of padding: -1
            buckets = module._relative_position_bucket(
                distance, bidirectional=True, num_buckets=module.relative_attention_num_buckets,
                max_distance=module.relative_attention_max_distance,
            )
            side_bias = patch.first.global_relative_attention_bias(buckets).t()[None, :, None]  # (1, H, 1, G)
            scores = torch.cat([scores, rows @ side_key.transpose(-1, -2) + side_bias], dim=-1)
            values = torch.cat([values, side_value], dim=2)
        scores = scores.float()
        weights = torch.softmax(scores - scores.detach(), dim=-1)  # uniform, with softmax's gradient
        held = padding[e, c]  # (m, r + 1): the block's positions that are padding
        out = (weights.to(values.dtype) @ values).transpose(1, 2)[held]  # (n', H, D)
        i = (c[:, None] * block + torch.arange(block, device=c.device))[held]
        e = e[:, None].expand(-1, block)[held]
    else:
        sums = by_block(value).sum(3)  # (B, H, blocks + 2, D)
        total = sums[:, :, :-2] + sums[:, :, 1:-1] + sums[:, :, 2:]  # (B, H, blocks, D): the three blocks' slots
        count = 3 * block
        if side is not None:
            total = total + side[1].sum(2, keepdim=True)
            count += side[1].shape[2]
        e, i = padding.view(b, -1).nonzero(as_tuple=True)
        out = (total / count)[e, :, i // block]  # (n', H, D)
    if side is not None:
        empty = (segments == 0).any(-1)[e]  # (n',): summaries of empty blocks, which padding sees
        out = torch.where(empty[:, None, None], torch.zeros_like(out), out)
    return e, i, out


def _global_part(module, patch, hidden_states, query, mask2d, dropout, backend, start=0, seq_len=None, reduce=None):
    """TGlobal's summary keys: ``(out (B, H, n, D), lse (B, H, n), (side_key, side_value) (B, H, G, D) each,
    segments (B, G))`` for the ``n = query.shape[2]`` queries from position ``start`` (the rest are padding), the
    summaries from the whole sequence: ``hidden_states`` (B, N', d_model) are the rows from ``start`` (all N of
    them, or a context-parallel shard), ``mask2d`` (B, N) or None the whole sequence's mask (``seq_len`` N: default
    the rows'), and ``reduce`` (default none) sums the shards' per-block sums over the ranks."""
    from transformers.models.longt5.modeling_longt5 import _make_global_fixed_block_ids

    b, h, n, d = query.shape
    size = module.global_block_size
    if mask2d is None:
        mask2d = torch.ones(b, seq_len or hidden_states.shape[1], device=hidden_states.device)
    block_ids, segments = _make_global_fixed_block_ids(mask2d, size)  # (B, N) int, (B, G) int
    block_ids = block_ids[:, start:]  # from this shard's first position
    blocks = segments.shape[-1]  # G = N // size
    # Summaries: the sum of each block's states ((B, G, d_model); transformers sums with a one-hot einsum).
    ids = torch.where(block_ids >= 0, block_ids, blocks).long()[:, : hidden_states.shape[1]]
    sums = hidden_states.new_zeros(b, blocks + 1, hidden_states.shape[-1])
    sums = sums.scatter_add(1, ids[..., None].expand(-1, -1, hidden_states.shape[-1]), hidden_states)[:, :blocks]
    if reduce is not None:
        sums = reduce(sums)
    summaries = module.global_input_layer_norm(sums)
    side_key = module.k(summaries).view(b, blocks, h, d).transpose(1, 2)  # (B, H, G, D)
    side_value = module.v(summaries).view(b, blocks, h, d).transpose(1, 2)
    visible = segments == 1  # (B, G): the summaries a real token sees
    if blocks == 0:
        empty = query.new_zeros(b, h, n, d)
        return empty, torch.full((b, h, n), float("-inf"), device=query.device), (side_key, side_value), segments
    # Row t of batch element e holds the queries i = c * size + t, c = 0 .. ceil(N / size) - 1: query c and summary
    # c' sit at positions c and c', so the side bias w_{b(c' - c)} is an offset bias.
    rows = -(-n // size)
    padded = nn.functional.pad(query, (0, 0, 0, rows * size - n))  # (B, H, rows * size, D)
    q_rows = padded.view(b, h, rows, size, d).permute(0, 3, 1, 2, 4).reshape(b * size, h, rows, d)
    k_rows = side_key[:, None].expand(b, size, h, blocks, d).reshape(b * size, h, blocks, d)
    v_rows = side_value[:, None].expand(b, size, h, blocks, d).reshape(b * size, h, blocks, d)
    m_rows = None  # every summary visible (no padding): no mask
    if not bool(visible.all()):
        m_rows = visible[:, None, None, None, :].expand(b, size, 1, 1, blocks).reshape(b * size, 1, 1, blocks)
    bias = _shared_bias(patch.global_bias, patch.first.global_relative_attention_bias.weight)
    out, lse = attention(
        q_rows, k_rows, v_rows, bias=bias, mask=m_rows, convention="t5", query_start=start // size, key_start=0,
        return_lse=True, dropout_p=dropout, **backend,
    )  # (B * size, H, rows, D), (B * size, H, rows); a shard starts at a block's first position
    out = out.view(b, size, h, rows, d).permute(0, 2, 3, 1, 4).reshape(b, h, rows * size, d)[:, :, :n]
    lse = lse.view(b, size, h, rows).permute(0, 2, 3, 1).reshape(b, h, rows * size)[:, :, :n]
    # Tokens of an incomplete last block belong to the block before: their side bias is computed apart.
    positional = torch.arange(start, start + n, device=block_ids.device) // size
    moved = (mask2d[:, start:start + n] != 0) & (block_ids[:, :n] >= 0) & (block_ids[:, :n] != positional)
    if bool(moved.any()):
        e, i = moved.nonzero(as_tuple=True)
        distance = torch.arange(blocks, device=query.device)[None, :] - block_ids[e, i].long()[:, None]  # (n', G)
        buckets = module._relative_position_bucket(
            distance, bidirectional=not module.is_decoder, num_buckets=module.relative_attention_num_buckets,
            max_distance=module.relative_attention_max_distance,
        )
        side_bias = patch.first.global_relative_attention_bias(buckets).permute(0, 2, 1)  # (n', H, G)
        q_moved = query[e, :, i]  # (n', H, D)
        scores = torch.einsum("nhd,nhgd->nhg", q_moved, side_key[e]).float() + side_bias.float()
        scores = scores.masked_fill(~visible[e][:, None, :], float("-inf"))
        lse_moved = torch.logsumexp(scores, dim=-1)  # (n', H)
        weights = torch.exp(scores - lse_moved.masked_fill(torch.isinf(lse_moved), 0.0)[..., None])
        weights = nn.functional.dropout(weights, p=dropout, training=dropout > 0)
        out_moved = torch.einsum("nhg,nhgd->nhd", weights.to(side_value.dtype), side_value[e])
        out = out.transpose(1, 2).index_put((e, i), out_moved).transpose(1, 2)
        lse = lse.transpose(1, 2).index_put((e, i), lse_moved.to(lse.dtype)).transpose(1, 2)
    return out, lse, (side_key, side_value), segments
