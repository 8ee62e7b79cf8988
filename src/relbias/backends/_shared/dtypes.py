"""The dtype softmax and its accumulations run in."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, else float32 (docs/conventions.md, Numerics)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
