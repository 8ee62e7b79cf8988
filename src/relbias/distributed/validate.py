"""Every check of context-parallel attention, made before any communication.

The checks read only what every rank of the group shares (shapes, settings, the bias module), so a refused
call is refused on every rank alike, before anything is sent, and no rank is left waiting for another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._attention_inputs import check_bias, check_qkv, resolve_convention
from .._int_args import check_int
from ..call import _dropout
from ..backends.structured import far_distance
from ..biases.base import RelativeBias
from .ring.blocks import BlockSettings
from .groups import resolve_group
from .layout import check_layout, shard_pieces
from .halo.plan import halo_reach
from .ring.plan import resolve_kv_chunks
from ..window import check_window, offset_band

__all__ = ["STRATEGIES", "ContextParallelCall", "check_context_parallel"]

#: The strategies context-parallel attention knows; "auto" picks "halo" or "ring" (:func:`resolve_strategy`).
STRATEGIES = ("auto", "ring", "ulysses", "halo")


@dataclass(frozen=True)
class ContextParallelCall:
    """A validated context-parallel call.

    Attributes:
        group: the process group (None: the default group); world_size P and rank r in it.
        layout: "contiguous" or "zigzag".
        strategy: "ring", "ulysses" or "halo" (resolved: never "auto").
        local_len: L/P, tokens per rank; seq_len: L.
        mask: None or the bool key padding mask shard (Bm, Hm, 1, L/P).
        settings: the :class:`relbias.distributed.ring.blocks.BlockSettings` of every block.
        kv_chunks: the chunks (>= 1, resolved) in which a shard's keys and values travel the ring.
        sync_bias_grads: sum the bias parameters' gradients over the group in backward (True) or leave each rank
            its own part (False).
    """

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    layout: str
    strategy: str
    local_len: int
    mask: torch.Tensor | None
    settings: BlockSettings
    kv_chunks: int = 1
    sync_bias_grads: bool = True

    @property
    def seq_len(self) -> int:
        return self.local_len * self.world_size


def _check_mask(mask: object, query: torch.Tensor, local_len: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"context-parallel attention takes a bool key padding mask (True = may attend) or None, got "
            f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}"
        )
    b, h = query.shape[:2]
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h) or mask.shape[2] != 1 or mask.shape[3] != local_len:
        raise ValueError(
            f"the mask must be this rank's shard of a key padding mask, bool (B or 1, H or 1, 1, L/P) = "
            f"({b} or 1, {h} or 1, 1, {local_len}), sharded like the keys; got {tuple(mask.shape)}"
        )
    if mask.device != query.device:
        raise ValueError(f"mask is on {mask.device} but query is on {query.device}")


def _check_bias_range(bias: RelativeBias, seq_len: int, is_causal: bool, device: torch.device,
                      window: tuple[int | None, int | None] | None = None) -> None:
    """Evaluate the bias at the extreme global offsets a query may see (the window's band, if any), so that a table
    too short for them (a per-offset bias with out_of_range="error") is refused here, on every rank, and not inside
    one rank's block."""
    if not bias.offset_only:
        return
    lo, hi = offset_band(window, is_causal)
    low, high = -(seq_len - 1), seq_len - 1
    low, high = low if lo is None else max(low, lo), high if hi is None else min(high, hi)
    bias.offset_values(torch.tensor([low, high], device=device))


def resolve_strategy(strategy: str, layout: str, window: tuple[int | None, int | None] | None, is_causal: bool,
                     local_len: int) -> str:
    """The strategy a call runs: ``strategy`` itself, or for "auto" "halo" where a contiguous layout meets a window
    bounded on both sides (the right by ``is_causal`` too) whose halo, ``left + right`` keys, is at most two shards
    (no more than the ring holds in flight), else "ring".

    Raises:
        ValueError: "halo" with layout "zigzag" (a rank's two chunks are not next to its neighbours' shards; under a
            window the contiguous layout is already balanced), or with a window unbounded on a side (no window: the
            halo would be the whole sequence on that side).
    """
    reach = halo_reach(window, is_causal)
    if strategy == "auto":
        return "halo" if layout == "contiguous" and reach is not None and sum(reach) <= 2 * local_len else "ring"
    if strategy == "halo":
        if layout != "contiguous":
            raise ValueError(
                f"strategy 'halo' exchanges the keys next to each contiguous shard, so it needs layout='contiguous', "
                f"got {layout!r} (zigzag balances causal work over the whole sequence; under a window every query "
                f"sees as many keys, so the contiguous layout is already balanced); use layout='contiguous' or "
                f"strategy='ring'"
            )
        if reach is None:
            raise ValueError(
                f"strategy 'halo' needs a window bounded on both sides (the right side by is_causal=True too), got "
                f"window={window} with is_causal={is_causal}; without a bound a rank needs every key on that side: "
                f"use strategy='ring'"
            )
    return strategy


def check_context_parallel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: object,
    mask: object,
    is_causal: object,
    scale: float | None,
    convention: str | None,
    group: object,
    layout: object,
    strategy: object,
    kv_chunks: object = None,
    sync_bias_grads: object = True,
    window: object = None,
    dropout_p: object = 0.0,
    generator: object = None,
) -> ContextParallelCall:
    """Validate the arguments of :func:`relbias.distributed.context_parallel_attention`.

    Raises:
        RuntimeError: torch.distributed is not available or not initialised.
        TypeError, ValueError: as :func:`relbias.distributed.context_parallel_attention` documents.
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_layout(layout)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context-parallel attention needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group first (e.g. under torchrun)"
        )
    group = resolve_group(group)
    if not isinstance(sync_bias_grads, bool):
        raise TypeError(f"sync_bias_grads must be a bool, got {sync_bias_grads!r}")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the process group it passed as group=; "
            f"only the group's ranks call context-parallel attention over it"
        )
    check_qkv(query, key, value)
    b, h, local_len, d = query.shape
    if key.shape[2] != local_len:
        raise ValueError(
            f"context-parallel self-attention shards queries and keys alike: the local query length {local_len} "
            f"and key length {key.shape[2]} must be equal"
        )
    if local_len == 0:
        raise ValueError("the local shard is empty (length 0); every rank must hold L/P >= 1 tokens")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"layout 'zigzag' gives each rank 2 equal chunks, so the local length must be even; got {local_len} "
            f"on {world_size} ranks (sequence length {local_len * world_size} is not divisible by "
            f"2P = {2 * world_size})"
        )
    if strategy == "ulysses" and h % world_size:
        raise ValueError(
            f"strategy 'ulysses' shards the {h} heads over {world_size} ranks, so num_heads must be divisible by "
            f"the group size; {h} % {world_size} = {h % world_size} (use strategy='ring')"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    window = check_window(window)
    if bias is not None and not isinstance(bias, RelativeBias):
        raise TypeError(
            f"context-parallel attention takes a RelativeBias module or None as bias, got {type(bias).__name__} "
            f"(a materialised bias tensor has no global positions; pass the module)"
        )
    check_bias(bias, query, (b, h, local_len, local_len))
    convention, scale = resolve_convention(convention, bias, scale, d)
    _check_mask(mask, query, local_len)
    if bias is not None:
        if not bias.bidirectional and not is_causal and not (window is not None and window[1] == 0):
            raise ValueError(
                "the bias is causal (bidirectional=False) and has no value for future keys (offset i - j < 0); "
                "pass is_causal=True"
            )
        _check_bias_range(bias, local_len * world_size, is_causal, query.device, window)
    strategy = resolve_strategy(strategy, layout, window, is_causal, local_len)
    if strategy == "ring":
        pieces = len(shard_pieces(local_len * world_size, world_size, rank, layout))
        chunks = resolve_kv_chunks(kv_chunks, local_len, pieces, world_size)
    else:  # nothing travels the ring: the value is only type-checked
        if kv_chunks is not None:
            check_int("kv_chunks", kv_chunks, minimum=1)
        chunks = 1
    dropout = _dropout(dropout_p, generator, query.device)  # this rank's seed; the call runs on rank 0's
    if dropout is not None and strategy != "halo":
        raise ValueError(
            f"context-parallel attention with dropout_p={dropout_p} runs on strategy 'halo' (local attention on "
            f"contiguous shards, every head on every rank, so each block draws the mask bits one process would); "
            f"strategy {strategy!r} takes no dropout"
        )
    settings = BlockSettings(
        bias, is_causal, scale, convention, None if dropout else far_distance(bias), window,
        0.0 if dropout is None else dropout.p, None if dropout is None else dropout.seed,
    )
    return ContextParallelCall(
        group, world_size, rank, layout, strategy, local_len, mask, settings, chunks, sync_bias_grads
    )
