"""Whether every rank of the group passed the same shapes and settings: one small all_gather before any exchange.

Context-parallel attention needs equal shapes and settings on every rank (the ring's messages are sized by them). A
rank that differs would otherwise make the transport fail (gloo aborts the process on a message of an unexpected
size) or wait for a message that never comes; gathering a few integers first turns that into the same ValueError,
naming the setting and each rank's value, on every rank.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from .layout import LAYOUTS
from .validate import STRATEGIES, ContextParallelCall

__all__ = ["check_ranks_agree"]


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
          "strategy": STRATEGIES.__getitem__, "is_causal": bool, "scale": _float, "sync_bias_grads": bool}


def _settings(call: ContextParallelCall, query: torch.Tensor, value: torch.Tensor) -> dict[str, int]:
    """What must be equal on every rank, each as an int."""
    b, h, local_len, d = query.shape
    bias, mask, settings = call.settings.bias, call.mask, call.settings
    return {
        "batch": b, "num_heads": h, "local length (L/P)": local_len, "head_dim": d, "value head_dim": value.shape[-1],
        "dtype": _dtype_code(query.dtype), "layout": LAYOUTS.index(call.layout),
        "strategy": STRATEGIES.index(call.strategy), "is_causal": int(settings.is_causal),
        "scale": _bits(settings.scale), "bias (num_heads, 0: none)": 0 if bias is None else bias.num_heads,
        "mask (batch, 0: none)": 0 if mask is None else mask.shape[0],
        "mask (num_heads, 0: none)": 0 if mask is None else mask.shape[1], "kv_chunks": call.kv_chunks,
        "sync_bias_grads": int(call.sync_bias_grads),
        "window left (-1: none)": _side(settings.window, 0), "window right (-1: none)": _side(settings.window, 1),
    }


def _side(window: tuple[int | None, int | None] | None, index: int) -> int:
    """One side of a validated window as an int: -1 for no window or no bound on that side."""
    side = None if window is None else window[index]
    return -1 if side is None else side


def check_ranks_agree(call: ContextParallelCall, query: torch.Tensor, value: torch.Tensor) -> None:
    """Refuse a call whose ranks passed different shapes or settings (one ``all_gather`` of a few int64s on the
    inputs' device; nothing on one rank).

    Args:
        call: the rank's validated call; query: (B, H, L/P, D) and value: (B, H, L/P, Dv), its shards.

    Raises:
        ValueError: on every rank alike, naming each setting that differs and every rank's value of it.
    """
    if call.world_size == 1:
        return
    mine = _settings(call, query, value)
    local = torch.tensor(list(mine.values()), dtype=torch.int64, device=query.device)
    every = [torch.empty_like(local) for _ in range(call.world_size)]
    dist.all_gather(every, local, group=call.group)
    rows = torch.stack(every).tolist()
    differ = [
        f"{name}: {[_SHOWN.get(name, int)(row[n]) for row in rows]}"
        for n, name in enumerate(mine) if len({row[n] for row in rows}) > 1
    ]
    if differ:
        raise ValueError(
            f"the ranks of the group passed different shapes or settings to context-parallel attention (per rank, in "
            f"group rank order): {'; '.join(differ)}; every rank must pass the same ones"
        )
