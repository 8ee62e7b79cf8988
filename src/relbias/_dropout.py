"""Attention dropout with a counter-based mask: the same (seed, batch, head, query, key) always drops the same
probability, whatever the tiling, so a backward pass regenerates the forward's mask tile by tile and the
reference and blockwise backends drop exactly the same entries.

The mask bit of entry (b, h, i, j) (i, j absolute query and key positions, tokens) is a 32-bit integer hash of
the five numbers (the "lowbias32" mixer of Chris Wellons' hash prospector, applied after each coordinate is
xored in), kept when the hash is at least ``p * 2**32``; kept probabilities are scaled by ``1 / (1 - p)``
(Srivastava et al. 2014, inverted dropout; applied to the attention probabilities as in Vaswani et al. 2017,
§5.4, and FlashAttention's counter-based dropout, Dao et al. 2022, §3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Dropout"]

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), by 16-bit halves of ``c`` (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@dataclass(frozen=True)
class Dropout:
    """Dropout of attention probabilities for one call.

    Attributes:
        p: drop probability in (0, 1).
        seed: 31-bit seed drawn once per call.
        query_start, key_start: absolute positions (tokens) of the call's first query and key; masks are keyed
            by absolute positions, so blocks of one sequence (split keys, shards) draw consistent bits.
    """

    p: float
    seed: int
    query_start: int
    key_start: int

    def scale_tile(self, batch: int, heads: int, t0: int, t1: int, s0: int, s1: int, device, dtype) -> torch.Tensor:
        """(B, H, t1 - t0, s1 - s0) factors for queries t0:t1 and keys s0:s1 of the call: 0 where dropped,
        ``1 / (1 - p)`` where kept, in ``dtype``."""
        def coordinate(values: torch.Tensor, dim: int) -> torch.Tensor:
            shape = [1, 1, 1, 1]
            shape[dim] = values.numel()
            return (values & _M32).reshape(shape)

        index = lambda n: torch.arange(n, device=device)  # noqa: E731
        h = _mix(torch.full((1, 1, 1, 1), self.seed & _M32, device=device, dtype=torch.int64))
        h = _mix(h ^ coordinate(index(batch), 0))
        h = _mix(h ^ coordinate(index(heads), 1))
        h = _mix(h ^ coordinate(index(t1 - t0) + (self.query_start + t0), 2))
        h = _mix(h ^ coordinate(index(s1 - s0) + (self.key_start + s0), 3))
        keep = h >= int(self.p * 2**32)
        return keep.to(dtype) * (1.0 / (1.0 - self.p))
