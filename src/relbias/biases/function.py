"""A bias given by any function of the offset: ``PE(i, j) = f(i - j)``, the general relative position bias."""

from __future__ import annotations

from typing import Callable

import torch

from .base import CONVENTIONS, RelativeBias

__all__ = ["FunctionBias"]


class FunctionBias(RelativeBias):
    """Wraps a user function of the offset ``i - j`` (and of the head) as a relative position bias.

    ``fn`` receives an int64 tensor of offsets of shape S (tokens; positive = past key) and returns a
    float tensor of shape ``(num_heads, *S)``, or ``S`` when ``num_heads == 1``. If ``fn`` is an
    ``nn.Module`` it is registered as a submodule, so its parameters train with the model.

    Args:
        fn: the function ``offsets -> values`` (logits).
        num_heads: H of the output; 1 (default) broadcasts one bias over every head.
        bidirectional: False declares the function defined for past keys only (future keys masked).
        default_convention: score convention used by :func:`relbias.attention` when none is given;
            "seed" (default) is the seed formula ``((q.k) + PE) * scale``.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: bad ``num_heads`` or convention; from :meth:`offset_values`, ``fn`` returning a
            tensor of the wrong shape or a non-float dtype, or NaN/inf values.

    Example:
        >>> bias = FunctionBias(lambda offset: -0.1 * offset.abs().float())  # a fixed linear decay
        >>> bias(3, 5).shape  # (num_heads, query_len, key_len)
        torch.Size([1, 3, 5])
    """

    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        num_heads: int = 1,
        bidirectional: bool = True,
        default_convention: str = "seed",
    ) -> None:
        super().__init__()
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        if default_convention not in CONVENTIONS:
            raise ValueError(f"default_convention must be one of {CONVENTIONS}, got {default_convention!r}")
        self.fn = fn  # an nn.Module is registered as a submodule by nn.Module.__setattr__
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        self.default_convention = default_convention

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        values = self.fn(offsets)
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            kind = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"the bias function must return a float tensor, got {kind}")
        expected = (self.num_heads, *offsets.shape)
        if self.num_heads == 1 and values.shape == offsets.shape:
            values = values.unsqueeze(0)
        if values.shape != expected:
            raise ValueError(
                f"the bias function returned shape {tuple(values.shape)} for offsets of shape "
                f"{tuple(offsets.shape)}; expected {expected} (num_heads, *offsets.shape)"
            )
        if values.device.type != "meta":
            bad = ~torch.isfinite(values)
            if bool(bad.any()):
                offset = int(offsets.expand(values.shape)[bad][0])
                raise ValueError(
                    f"the bias function returned {float(values[bad][0])} at offset {offset}; a bias must be "
                    f"finite (hide keys with mask=, not with an infinite bias)"
                )
        return values

    def describe(self) -> dict[str, object]:
        """Constants: ``function``, the name of ``fn`` (its ``__qualname__``, or its class name)."""
        return {"function": getattr(self.fn, "__qualname__", type(self.fn).__name__)}
