"""Tile-level pieces shared by the memory-efficient backends: where a bias tile comes from, where its
gradient goes, and which entries of a tile are visible.

Everything here works on one (query block, key block) tile at a time, so nothing of size
(Lq, Lk) is ever built. Offsets follow ``docs/conventions.md``: ``offset = i - j``; a tile starting at
query index ``t0`` and key index ``s0`` holds offsets ``delta + (t0 + t) - (s0 + s)`` with
``delta = query_start - key_start``.
"""

from __future__ import annotations

import torch

__all__ = ["NativeSource", "PairSource", "diagonal_sums", "mask_tile", "relative_index"]

_RELATIVE: dict[tuple[int, int, str], torch.Tensor] = {}


def relative_index(tile_q: int, tile_k: int, device: torch.device) -> torch.Tensor:
    """int64 (Tq, Tk) matrix ``t - s``; cached per shape and device (it is small and reused by every tile)."""
    key = (tile_q, tile_k, str(device))
    index = _RELATIVE.get(key)
    if index is None:
        index = torch.arange(tile_q, device=device)[:, None] - torch.arange(tile_k, device=device)[None, :]
        if len(_RELATIVE) > 64:
            _RELATIVE.clear()
        _RELATIVE[key] = index
    return index


def diagonal_sums(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (..., Tq, Tk) along its diagonals: (..., Tq + Tk - 1); entry ``n`` sums ``t - s = n - (Tk - 1)``.

    Deterministic (a fixed reshape and one ``sum``; no atomics): flip the columns so that diagonals
    become anti-diagonals, pad each row with Tq zeros and re-read the flat buffer with rows one shorter,
    which puts anti-diagonal ``t + s'`` in column ``t + s'``; then sum the rows.
    """
    *lead, tq, tk = x.shape
    width = tk + tq
    padded = torch.nn.functional.pad(x.flip(-1), (0, tq))  # (..., Tq, Tk + Tq)
    skewed = padded.reshape(*lead, tq * width)[..., : tq * (width - 1)].reshape(*lead, tq, width - 1)
    return skewed.sum(dim=-2)


def mask_tile(mask: torch.Tensor, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
    """The (t0:t1, s0:s1) tile of a 4-D broadcastable mask; dimensions of size 1 stay size 1."""
    rows = slice(t0, t1) if mask.shape[-2] > 1 else slice(None)
    cols = slice(s0, s1) if mask.shape[-1] > 1 else slice(None)
    return mask[..., rows, cols]


class NativeSource:
    """Bias tiles looked up in a native per-offset vector, and their gradient summed back along diagonals.

    Args:
        values: float (Hb, Lq + Lk - 1), the native values (detached), Hb in {1, H}; column ``n`` is
            offset ``min_offset + n``.
        min_offset: offset of column 0.
        delta: ``query_start - key_start``.
        bias_scale: factor the score convention applies to the bias (``scale`` for "seed", else 1).
        compute: dtype of the tiles (float32, or float64 for float64 inputs).
    """

    def __init__(self, values: torch.Tensor, min_offset: int, delta: int, bias_scale: float, compute: torch.dtype):
        self.values = values.detach().to(compute) * bias_scale  # (Hb, n), already scaled
        self.base = delta - min_offset
        self.bias_scale = bias_scale
        self.grad = torch.zeros_like(self.values)
        self.translation_invariant = True  # a tile depends on its size and delta + t0 - s0 only

    def tile(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        """(Hb, Tq, Tk) scaled bias of the tile, broadcastable against (B, H, Tq, Tk) scores."""
        index = relative_index(t1 - t0, s1 - s0, self.values.device) + (self.base + t0 - s0)
        return self.values[:, index]

    def add_grad(self, dscores: torch.Tensor, t0: int, s0: int) -> None:
        """Accumulate d(loss)/d(scores) of a tile, (B, H, Tq, Tk), into the gradient of the native values."""
        g = dscores.sum(dim=0)  # (H, Tq, Tk)
        if self.values.shape[0] == 1:
            g = g.sum(dim=0, keepdim=True)
        tq, tk = g.shape[-2:]
        start = self.base + t0 - s0 - (tk - 1)
        self.grad[:, start : start + tq + tk - 1] += diagonal_sums(g)

    def native_grad(self) -> torch.Tensor:
        """Gradient with respect to the unscaled native values, (Hb, n)."""
        return self.grad * self.bias_scale


class PairSource:
    """Bias tiles of a family that reads absolute positions (``offset_only = False``): ``pair_values`` per tile.

    The forward evaluates tiles without autograd; :meth:`add_grad` re-evaluates the tile with autograd on
    and back-propagates the tile's score gradient into the module parameters.

    Args:
        module: the bias module (a :class:`relbias.RelativeBias` with ``pair_values``).
        params: its parameters that require grad, in a fixed order.
        query_start, key_start: absolute positions (tokens) of the first query and key.
        bias_scale: factor the score convention applies to the bias.
        compute: dtype of the tiles.
    """

    def __init__(self, module, params, query_start: int, key_start: int, bias_scale: float, compute: torch.dtype):
        self.module, self.params = module, list(params)
        self.query_start, self.key_start = query_start, key_start
        self.bias_scale, self.compute = bias_scale, compute
        self.grads = [torch.zeros_like(p) for p in self.params]
        self.device = module._device()

    def _values(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        qpos = torch.arange(self.query_start + t0, self.query_start + t1, device=self.device)
        kpos = torch.arange(self.key_start + s0, self.key_start + s1, device=self.device)
        return self.module.pair_values(qpos, kpos).to(self.compute) * self.bias_scale  # (Hb, Tq, Tk)

    def tile(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        with torch.no_grad():
            return self._values(t0, t1, s0, s1)

    def add_grad(self, dscores: torch.Tensor, t0: int, s0: int) -> None:
        if not self.params:
            return
        tq, tk = dscores.shape[-2:]
        g = dscores.sum(dim=0)
        with torch.enable_grad():
            values = self._values(t0, t0 + tq, s0, s0 + tk)
            if values.shape[0] == 1:
                g = g.sum(dim=0, keepdim=True)
            grads = torch.autograd.grad(values, self.params, grad_outputs=g, allow_unused=True)
        for acc, grad in zip(self.grads, grads):
            if grad is not None:
                acc += grad
