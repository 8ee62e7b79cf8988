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


def _int32(c: int) -> int:
    """The int32 whose two's-complement bits are those of ``c mod 2**32``."""
    c &= _M32
    return c - 2**32 if c >= 2**31 else c


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place, on an int32 tensor whose bits are the uint32 values: multiplication wraps modulo 2**32
    as uint32's does, and a logical right shift is the arithmetic one with the sign bits masked off. Returns x."""
    shifted = torch.empty_like(x)  # one scratch tensor for the three shifts

    def xorshift(bits: int) -> None:  # x ^= x >> bits, logical
        torch.bitwise_right_shift(x, bits, out=shifted)
        x.bitwise_xor_(shifted.bitwise_and_((1 << (32 - bits)) - 1))

    xorshift(16)
    x.mul_(_int32(0x7FEB352D))
    xorshift(15)
    x.mul_(_int32(0x846CA68B))
    xorshift(16)
    return x


@dataclass(frozen=True)
class Dropout:
    """Dropout of attention probabilities for one call.

    Attributes:
        p: drop probability in (0, 1).
        seed: 31-bit seed drawn once per call: an int, or under ``torch.compile`` a 0-dim int64 tensor drawn in the
            graph (read by the kernels where they run, so no value leaves the graph).
        query_start, key_start: absolute positions (tokens) of the call's first query and key; masks are keyed
            by absolute positions, so blocks of one sequence (split keys, shards) draw consistent bits.
    """

    p: float
    seed: int | torch.Tensor
    query_start: int
    key_start: int

    def scale_tile(self, batch: int, heads: int, t0: int, t1: int, s0: int, s1: int, device, dtype) -> torch.Tensor:
        """(B, H, t1 - t0, s1 - s0) factors for queries t0:t1 and keys s0:s1 of the call: 0 where dropped,
        ``1 / (1 - p)`` where kept, in ``dtype``."""
        def coordinate(start: int, n: int, dim: int) -> torch.Tensor:  # positions start .. start + n - 1, int32 bits
            shape = [1, 1, 1, 1]
            shape[dim] = n
            values = (torch.arange(n, device=device) + start + 2**31) % 2**32 - 2**31  # int64, into int32's range
            return values.to(torch.int32).reshape(shape)

        if isinstance(self.seed, torch.Tensor):  # 31 bits: int32 holds it as it is
            h = _mix_(self.seed.to(device=device, dtype=torch.int32).reshape(1, 1, 1, 1).clone())
        else:
            h = _mix_(torch.full((1, 1, 1, 1), _int32(self.seed), device=device, dtype=torch.int32))
        h = _mix_(h ^ coordinate(0, batch, 0))
        h = _mix_(h ^ coordinate(0, heads, 1))
        h = _mix_(h ^ coordinate(self.query_start + t0, t1 - t0, 2))
        h = _mix_(h ^ coordinate(self.key_start + s0, s1 - s0, 3))  # (B, H, t1 - t0, s1 - s0)
        # kept: hash >= threshold as uint32, i.e. as int32 once both have their top bit flipped
        keep = (h ^ _int32(2**31)) >= _int32(int(self.p * 2**32) ^ 2**31)
        scale = torch.tensor(1.0 / (1.0 - self.p), dtype=dtype, device=device)
        return torch.where(keep, scale, torch.zeros((), dtype=dtype, device=device))
