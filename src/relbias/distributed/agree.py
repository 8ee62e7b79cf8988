"""Whether every rank of the group passed the same shapes and settings, and accepted its call: one small
all_gather before any exchange.

Context-parallel attention needs equal shapes and settings on every rank (the ring's messages are sized by them). A
rank that differs would otherwise make the transport fail (gloo aborts the process on a message of an unexpected
size) or wait for a message that never comes; gathering a few integers first turns that into the same ValueError,
naming the setting and each rank's value, on every rank. A rank whose own inputs are refused (a mask of the wrong
shape on that rank alone, say) takes part in the same gather with a refusal mark instead of leaving the others
waiting for it: then every rank raises, that rank its own error and the others one naming it and its message.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from .comm import exchange
from ..biases.base import CONVENTIONS
from .layout import LAYOUTS
from .validate import STRATEGIES, ContextParallelCall

__all__ = ["check_ranks_agree", "refuse_on_every_rank"]


def _dtype_code(dtype: torch.dtype) -> int:
    """The same int for the same dtype in every process (a checksum of its name)."""
    return zlib.crc32(str(dtype).encode())


_DTYPE_NAMES = {_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _bits(x: float) -> int:
    """A float's IEEE 754 double bits as an int64 (equal floats, equal ints)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


#: how the message shows a setting's int (the others: as it is)
_SHOWN = {"dtype": lambda code: _DTYPE_NAMES.get(code, code), "layout": LAYOUTS.__getitem__,
          "strategy": STRATEGIES.__getitem__, "is_causal": bool, "scale": _float, "sync_bias_grads": bool,
          "convention": CONVENTIONS.__getitem__, "dropout_p": _float}


#: What must be equal on every rank, in the order :func:`_settings` gives it.
_NAMES = (
    "batch", "num_heads", "local length (L/P)", "head_dim", "value head_dim", "dtype", "layout", "strategy",
    "is_causal", "scale", "bias (num_heads, 0: none)", "mask (batch, 0: none)", "mask (num_heads, 0: none)",
    "kv_chunks", "sync_bias_grads", "window left (-1: none)", "window right (-1: none)", "convention", "dropout_p",
)


def _settings(call: ContextParallelCall, query: torch.Tensor, value: torch.Tensor) -> dict[str, int]:
    """What must be equal on every rank, each as an int, by :data:`_NAMES`."""
    b, h, local_len, d = query.shape
    bias, mask, settings = call.settings.bias, call.mask, call.settings
    return dict(zip(_NAMES, (
        b, h, local_len, d, value.shape[-1], _dtype_code(query.dtype), LAYOUTS.index(call.layout),
        STRATEGIES.index(call.strategy), int(settings.is_causal), _bits(settings.scale),
        0 if bias is None else bias.num_heads, 0 if mask is None else mask.shape[0],
        0 if mask is None else mask.shape[1], call.kv_chunks, int(call.sync_bias_grads),
        _side(settings.window, 0), _side(settings.window, 1), CONVENTIONS.index(settings.convention),
        _bits(settings.dropout_p),
    ), strict=True))


def _side(window: tuple[int | None, int | None] | None, index: int) -> int:
    """One side of a validated window as an int: -1 for no window or no bound on that side; sides of 2**62 tokens or
    more (longer than any sequence, so alike in effect) as 2**62, which an int64 holds."""
    side = None if window is None else window[index]
    return -1 if side is None else min(side, 1 << 62)


_REFUSALS = {"TypeError": TypeError, "ValueError": ValueError}

#: Ints each rank gathers after its refusal mark: the settings of :data:`_NAMES`, then the dropout seed (-1: none).
_ROW_LEN = len(_NAMES) + 1


def _gather_rows(row: list[int], group, world_size: int, device: torch.device) -> list[list[int]]:
    """Every rank's ``row`` (a refusal mark, then the settings) in group rank order: one ``all_gather``."""
    local = torch.tensor(row, dtype=torch.int64, device=device)
    every = [torch.empty_like(local) for _ in range(world_size)]
    with exchange(group, "the check that every rank passed the same shapes and settings"):
        dist.all_gather(every, local, group=group)
    return torch.stack(every).tolist()


def _raise_refusals(rows: list[list[int]], group, world_size: int, mine: Exception | None) -> None:
    """Where a rank marked a refusal: gather every rank's message (``all_gather_object``, on this path only) and
    raise, ``mine`` on a rank that refused, else the first refusing rank's error type naming it."""
    refused = [r for r, row in enumerate(rows) if row[0]]
    if not refused:
        return
    messages = [None] * world_size
    dist.all_gather_object(messages, None if mine is None else (type(mine).__name__, str(mine)), group=group)
    if mine is not None:
        raise mine
    kind, text = messages[refused[0]]
    raise _REFUSALS.get(kind, ValueError)(
        f"rank {refused[0]} of the group refused this context-parallel call ({kind}: {text})"
        + (f"; ranks {refused} refused it in all" if len(refused) > 1 else "")
        + "; every rank raises, none is left waiting for it"
    )


def refuse_on_every_rank(refusal: Exception, query: object, group: object) -> None:
    """Raise ``refusal`` (a TypeError or ValueError from checking this rank's inputs) after telling the other ranks
    of ``group``, which are in :func:`check_ranks_agree` (or here): they raise too, naming this rank and the message.

    Where this rank cannot reach the group (torch.distributed not initialised, an invalid ``group``, a process
    outside it), it raises ``refusal`` at once: then no rank can run the call over that group.

    Raises:
        TypeError, ValueError: ``refusal``, always.
    """
    try:
        from .groups import resolve_group

        resolved = resolve_group(group)
        world_size, rank = dist.get_world_size(resolved), dist.get_rank(resolved)
    except Exception:
        raise refusal from None
    if rank < 0 or world_size == 1:
        raise refusal
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    rows = _gather_rows([1] + [0] * _ROW_LEN, resolved, world_size, device)
    _raise_refusals(rows, resolved, world_size, refusal)
    raise refusal


def check_ranks_agree(call: ContextParallelCall, query: torch.Tensor, value: torch.Tensor) -> int | None:
    """Refuse a call whose ranks passed different shapes or settings, or that a rank refused
    (:func:`refuse_on_every_rank`): one ``all_gather`` of a few int64s on the inputs' device; nothing on one rank.

    Args:
        call: the rank's validated call; query: (B, H, L/P, D) and value: (B, H, L/P, Dv), its shards.

    Returns:
        With dropout, the seed the group's rank 0 drew (every rank runs on it; the ranks' generators need not
        agree), else None.

    Raises:
        ValueError: on every rank alike, naming each setting that differs and every rank's value of it.
        TypeError, ValueError: another rank refused its inputs: the message names that rank and its error.
    """
    seed = call.settings.dropout_seed
    if call.world_size == 1:
        return seed
    mine = _settings(call, query, value)
    rows = _gather_rows([0, *mine.values(), -1 if seed is None else int(seed)], call.group, call.world_size,
                        query.device)
    _raise_refusals(rows, call.group, call.world_size, None)
    seed = None if seed is None else rows[0][-1]
    rows = [row[1:-1] for row in rows]
    differ = [
        f"{name}: {[_SHOWN.get(name, int)(row[n]) for row in rows]}"
        for n, name in enumerate(mine) if len({row[n] for row in rows}) > 1
    ]
    if differ:
        raise ValueError(
            f"the ranks of the group passed different shapes or settings to context-parallel attention (per rank, in "
            f"group rank order): {'; '.join(differ)}; every rank must pass the same ones"
        )
    return seed
