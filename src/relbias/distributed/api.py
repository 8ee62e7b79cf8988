"""``context_parallel_attention``: attention over a sequence sharded along its length across processes."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..biases.base import RelativeBias
from .agree import check_ranks_agree, refuse_on_every_rank
from .ring.plan import RingStats
from .halo.attention import halo_attention
from .ring.attention import ring_attention
from .ulysses.attention import ulysses_attention
from .validate import check_context_parallel

__all__ = ["context_parallel_attention"]


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | None = None,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    convention: str | None = None,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    layout: str = "contiguous",
    strategy: str = "auto",
    stats: RingStats | None = None,
    kv_chunks: int | None = None,
    sync_bias_grads: bool = True,
    window: tuple[int | None, int | None] | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Exact self-attention with a relative position bias over a sequence sharded along its length.

    Every rank of ``group`` calls it with its own shard and gets back its own output shard; the result equals
    single-device :func:`relbias.attention` on the unsharded tensors (same formula, conventions and masking,
    docs/conventions.md), sharded the same way. Global positions follow from the layout, so every bias family
    reads exact global offsets ``i - j``.

    Shape legend: B batch, H num_heads, L global sequence length (tokens), P group size, D head_dim,
    Dv value head_dim.

    Layouts (:mod:`relbias.distributed.layout`; :func:`shard` / :func:`unshard` cut and join full tensors)::

        "contiguous": rank r holds positions [r·L/P, (r+1)·L/P)
        "zigzag":     2P chunks of L/(2P); rank r holds chunks r and 2P-1-r (balanced causal work;
                      the load balancing of Brandon et al. 2023, Striped Attention, which stripes single
                      tokens; zigzag is the chunked form of ring-flash-attention and Megatron-LM)
                      P = 2, L = 8:  rank 0 -> 0 1 6 7,  rank 1 -> 2 3 4 5

    Strategies:

    * ``"ring"`` (Liu et al. 2023, Ring Attention): keys and values, with their positions and mask shard,
      rotate around the ring by point-to-point ops overlapped with compute; each (query piece, key piece)
      block runs ``relbias.attention(..., query_start=, key_start=, return_lse=True)`` and blocks merge by
      log-sum-exp, ``m = logaddexp(l1, l2)``, ``out = o1·exp(l1 - m) + o2·exp(l2 - m)`` (FlashAttention's
      split-KV merge). Causal blocks entirely in the future are skipped; with a far-constant bias (T5,
      ``PerOffsetBias(out_of_range="clip")``: ``bias.far_constant_distance()`` = T), a block whose offsets
      all satisfy ``|i - j| >= T`` runs bias-free attention and adds the per-head constant
      ``bias_scale · PE_h(±T)`` to its log-sum-exp. Backward recomputes each biased block (far blocks use the
      fused kernel's backward directly) and sends dK and dV around the ring to the ranks owning those keys. Any
      head count; memory O(L/P · D) per rank and head: the shard's own q, k, v, output and gradients, plus
      ``kv_chunks`` chunks of keys and values and their gradients in flight (``6/C`` shards).
    * ``"ulysses"`` (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from sequence shards to head shards
      (H/P heads each over the whole sequence), single-device ``relbias.attention`` with the bias sliced to the
      rank's heads, all-to-all back. Needs ``H % P == 0``.
    * ``"halo"`` (local attention, ``layout="contiguous"``, a ``window`` bounded on both sides, the right by
      ``is_causal`` too): a rank's queries see at most ``left`` keys before its shard and ``right`` after it, so
      the ranks those keys live on (several where the window is longer than a shard) send just them, with their
      values and mask entries, in one ``batch_isend_irecv`` overlapped with the rank's own block; the halo blocks
      merge by log-sum-exp, and backward returns the halo's dK and dV to their owners
      (:mod:`relbias.distributed.halo.attention`). Traffic per rank and call: at most ``(left + right)`` keys' rows forward
      and their gradients backward, however long the sequence and however many ranks; memory O((L/P + left +
      right) · D) per rank and head.
    * ``"auto"`` (default): "halo" where it applies and its halo, ``left + right`` keys, is at most ``2·L/P`` (no
      more than the ring holds in flight); otherwise "ring".

    Args:
        query: (B, H, L/P, D) this rank's shard, float16/bfloat16/float32/float64.
        key: (B, H, L/P, D), the same positions as ``query``; same dtype and device.
        value: (B, H, L/P, Dv), same positions, dtype and device.
        bias: None or a :class:`relbias.RelativeBias` module (num_heads 1 or H), the same on every rank
            (e.g. a replicated model's); its parameters' gradients are summed over the group (see
            ``sync_bias_grads``).
        mask: None or this rank's shard of a bool key padding mask (B or 1, H or 1, 1, L/P), True = may
            attend, sharded like the keys (``shard(full_mask, P, r, layout=..., dim=-1)``).
        is_causal: hide keys with offset ``i - j < 0`` (global positions). Default False.
        scale: multiplier of ``q . k``; default ``1 / sqrt(D)`` for "seed" and "additive", 1 for "t5".
        convention: "seed", "additive" or "t5"; default the bias's own ("seed" without a bias).
        group: the ranks that hold the shards, in rank order: a process group, or a 1-D ``DeviceMesh`` (a named
            dimension of a larger mesh, ``mesh["cp"]``, as FSDP2 and torchtitan compose them); default the default
            group.
        layout: "contiguous" (default) or "zigzag".
        strategy: "auto" (default), "ring", "ulysses" or "halo".
        stats: a :class:`relbias.distributed.RingStats` to which "ring" and "halo" add the counts of their forward
            blocks (skipped, bias-free, biased) and the bytes this rank sends and receives, forward and backward;
            ignored by "ulysses". Default None.
        kv_chunks: "ring": the chunks C in which a rank's keys and values travel, one full rotation of the ring
            per chunk, so that a rank holds 1/C of a shard's keys and values (and of their gradients) in flight
            instead of a whole shard, for C times as many messages of 1/C the size (the same bytes). 1: the whole
            shard at once; C > 1: a multiple of the shard's pieces (1 contiguous, 2 zigzag) whose chunks split every
            piece evenly. Default None: 1 on one rank; else 4, 2 or 1, the most that keep chunks whole and at least
            256 tokens long. "ulysses" and "halo" only check that it is None or an int >= 1.
        sync_bias_grads: True (default): the bias parameters' gradients come back summed over ``group``, complete
            on every rank, for a model replicated over the group whose other gradients the caller reduces itself.
            False: each rank keeps its own part, like every other parameter's gradient, for a data-parallel wrapper
            that reduces gradients over these ranks as well (FSDP2 over a flattened data x context mesh, DDP over
            the context ranks); summing them there again would count the bias's gradient P times.
        dropout_p: attention dropout on the probabilities (default 0.0), with "halo" only (refused otherwise, a
            ValueError): relbias' counter-based mask, a hash of a seed and the absolute (batch, head, query, key), so
            each block drops what one process would. The seed is drawn from ``generator`` (default torch's global
            RNG) on the group's rank 0 and used by every rank: ``relbias.attention(..., dropout_p=p,
            generator=g)`` on the unsharded tensors, ``g`` in the state rank 0's was in, drops the same entries.
        generator: the ``torch.Generator`` the dropout seed is drawn from (rank 0's counts); default None.
        window: local (sliding-window) attention at global positions, as :func:`relbias.attention`'s ``window``:
            None (default) or ``(left, right)``, ints >= 0 or None; query i sees keys ``i - left <= j <= i + right``.
            "ring": a block wholly outside every query's window is skipped (counted in ``stats.skipped``), one the
            window cuts runs with it; the key chunks still travel the whole ring. "halo": only the keys the window
            reaches travel. "ulysses": each rank's heads run the windowed call over the whole sequence.

    Returns:
        (B, H, L/P, Dv) this rank's output shard, in the dtype of ``query``; differentiable in query, key,
        value and the bias parameters. Softmax and merges accumulate in float32 (float64 for float64 inputs).
        A query with no visible key gets zeros. Every rank must run backward when one does (backward
        communicates).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: as :func:`relbias.attention`; a ``window`` that is not a pair of ints or None; a ``kv_chunks``
            neither None nor an int; a ``group`` that is not a
            process group, a DeviceMesh or None; a non-bool ``sync_bias_grads``; a bias that is not a
            RelativeBias module (tensor biases have no global positions); a mask that is not bool; a non-bool
            ``is_causal``.
        ValueError: a DeviceMesh of more than one dimension; an unknown ``layout`` or ``strategy``; "halo" with
            layout "zigzag" or a window unbounded on a side; a ``kv_chunks`` below 1 or not splitting the pieces
            evenly; local query and key lengths that differ; an odd local length with "zigzag" (L not divisible
            by 2P); ``H % P != 0`` with "ulysses"; a mask not shaped (B or 1, H or 1, 1, L/P); a causal-only
            bias without ``is_causal``; a bias that cannot evaluate the sequence's offsets (per-offset table
            shorter than L, ``out_of_range="error"``); a process outside ``group``; the errors of
            :func:`relbias.attention`; ranks that passed different shapes or settings (one ``all_gather`` of
            a few integers compares them before any keys travel; the message names each setting and every rank's
            value). Every rank raises alike, before keys or values are exchanged: where one rank's own inputs are
            refused (a mask of the wrong shape on that rank alone), that rank raises its error and every other rank
            the same type of error naming that rank and its message.
        RuntimeError: an exchange that did not complete: another rank raised or stopped in the middle of the call
            (or skipped its part of backward); each waiting rank raises when the process group's timeout
            (``init_process_group(timeout=...)``) ends its wait, or at once when the transport sees the other
            process gone, naming its rank and the exchange, chained to the transport's error.

    Example (under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("gloo")
        r, p = dist.get_rank(), dist.get_world_size()
        q = shard(full_q, p, r, layout="zigzag")          # (B, H, L/P, D), likewise k, v
        out = context_parallel_attention(q, k, v, bias=t5_bias, is_causal=True, layout="zigzag")
    """
    try:
        call = check_context_parallel(
            query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale, convention=convention,
            group=group, layout=layout, strategy=strategy, kv_chunks=kv_chunks, sync_bias_grads=sync_bias_grads,
            window=window, dropout_p=dropout_p, generator=generator,
        )
    except (TypeError, ValueError) as refusal:  # the other ranks learn of it rather than wait for this one
        refuse_on_every_rank(refusal, query, group)
    seed = check_ranks_agree(call, query, value)
    if seed is not None:  # every rank's blocks draw rank 0's mask
        call = dataclasses.replace(call, settings=dataclasses.replace(call.settings, dropout_seed=seed))
    if call.strategy == "ring":
        return ring_attention(call, query, key, value, stats)
    if call.strategy == "halo":
        return halo_attention(call, query, key, value, stats)
    return ulysses_attention(call, query, key, value)
