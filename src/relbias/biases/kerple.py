"""KERPLE: kernelized relative positional embedding (Chi et al. 2022, NeurIPS, §3-4).

Two variants from conditionally positive definite kernels of the distance ``|i - j|``, each with two
learnable positive scalars per head:

* logarithmic: ``PE_h(i, j) = -r1_h * log(1 + r2_h * |i - j|)``, r1, r2 > 0;
* power: ``PE_h(i, j) = -r1_h * |i - j| ** r2_h``, r1 > 0, 0 < r2 <= 2 (here 0 < r2 < 2, see below).

Positivity is kept by the parametrisation, not by clamping the stored values as the authors' code
does after each step: ``r1 = softplus(raw_r1)``, ``r2 = softplus(raw_r2)`` (log) or
``r2 = 2 * sigmoid(raw_r2)`` (power), so a parameter can never get stuck at a clamp boundary; the
bound r2 = 2 itself is approached but not reached.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._int_args import check_int
from .base import RelativeBias
from .registry import register_family

__all__ = ["KerpleLogBias", "KerplePowerBias"]

#: Smallest value a random initialisation draws (the authors clamp their parameters at 1e-2 too).
_INIT_EPS = 1e-2


def _initial(
    name: str, value: float | Sequence[float] | None, num_heads: int, high: float, upper_open: bool
) -> torch.Tensor:
    """Initial per-head values (H,) float32: given, or uniform in [eps, high - eps] like the authors' U(0, high)."""
    if value is None:
        return torch.rand(num_heads) * (high - 2 * _INIT_EPS) + _INIT_EPS
    values = torch.as_tensor(value, dtype=torch.float64)
    if values.dim() == 0:
        values = values.expand(num_heads)
    if values.shape != (num_heads,):
        raise ValueError(f"{name} must be a number or {num_heads} numbers (one per head), got shape {tuple(values.shape)}")
    bad = ~torch.isfinite(values) | (values <= 0) | ((values >= high) if upper_open else torch.zeros_like(values, dtype=torch.bool))
    if bool(bad.any()):
        bound = f"in (0, {high:g})" if upper_open else "> 0 and finite"
        got = value if isinstance(value, (int, float)) else values[bad].tolist()
        raise ValueError(f"{name} must be {bound}, got {got}")
    return values.float()


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))  # softplus(x + log(1 - e^-x)) = x


class _KerpleBias(RelativeBias):
    """Shared part of the two KERPLE variants: parameters, checks, constants (the distance is the base's)."""

    state_only = True  # values read the parameters (and buffers) only

    default_convention = "additive"
    distance_only = True
    _r2_high: float = 2.0  # bound of the default initialisation of r2 (U(0, 1) log, U(0, 2) power)
    _r1_high: float = 2.0
    _r2_bounded: bool = False  # True: r2 must lie in (0, _r2_high)

    def __init__(
        self,
        num_heads: int,
        *,
        bidirectional: bool = True,
        init_r1: float | Sequence[float] | None = None,
        init_r2: float | Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        check_int("num_heads", num_heads, minimum=1)
        if not isinstance(bidirectional, bool):
            raise TypeError(f"bidirectional must be a bool, got {bidirectional!r}")
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        r1 = _initial("init_r1", init_r1, num_heads, self._r1_high, upper_open=False)
        r2 = _initial("init_r2", init_r2, num_heads, self._r2_high, upper_open=self._r2_bounded)
        self.raw_r1 = nn.Parameter(_inverse_softplus(r1.double()).float())
        self.raw_r2 = nn.Parameter(self._r2_inverse(r2.double()).float())

    @staticmethod
    def _r2_inverse(r2: torch.Tensor) -> torch.Tensor:
        return _inverse_softplus(r2)

    @property
    def r1(self) -> torch.Tensor:
        """Scale r1 of each head, ``softplus(raw_r1)`` > 0: (H,) in the parameters' dtype."""
        return F.softplus(self.raw_r1)

    @property
    def r2(self) -> torch.Tensor:
        """Shape parameter r2 of each head, > 0: (H,) in the parameters' dtype."""
        return F.softplus(self.raw_r2)

    def _kernel(self, r1: torch.Tensor, r2: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        """The kernel at each offset: float (H, *S), logits, in the parameters' dtype; 0 at offset 0."""
        shape = (-1, *([1] * offsets.dim()))
        distance = self.distance(offsets).to(self.raw_r1.dtype)
        return self._kernel(self.r1.reshape(shape), self.r2.reshape(shape), distance)

    def describe(self) -> dict[str, object]:
        """Constants: ``r1`` and ``r2``, H values each, at their current (learned) values."""
        with torch.no_grad():
            return {"r1": self.r1.tolist(), "r2": self.r2.tolist()}

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, bidirectional={self.bidirectional}"


class KerpleLogBias(_KerpleBias):
    """KERPLE, logarithmic variant: ``PE_h(i, j) = -r1_h * log(1 + r2_h * |i - j|)`` (Chi et al. 2022, §3-4).

    Two learnable scalars per head, r1 (scale) and r2 (how fast the penalty bends), both > 0 through
    ``softplus``. Used with the additive score convention ``(q.k) * scale + PE + Mask`` (the paper adds
    the kernel to the scaled logits), this module's ``default_convention``.

    Causal (``bidirectional=False``, the paper's language-model setting): past keys use
    ``|i - j| = i - j``; future keys get 0 and must be masked. Bidirectional: the same kernel of
    ``|i - j|`` for keys on either side (the kernel is symmetric by construction).

    Args:
        num_heads: number of heads H, >= 1.
        bidirectional: True (default, as every family: docs/conventions.md; equal to the causal form on
            past keys), False for the causal-only form.
        init_r1: initial r1, a number or one per head, > 0; default uniform in [0.01, 1.99] (the
            authors' code draws U(0, 2) and clamps at 0.01).
        init_r2: initial r2, a number or one per head, > 0; default uniform in [0.01, 0.99] (U(0, 1)).

    Attributes:
        raw_r1, raw_r2: float32 parameters (H,); ``r1 = softplus(raw_r1)``, ``r2 = softplus(raw_r2)``.

    Raises:
        TypeError: ``num_heads`` not an int, ``bidirectional`` not a bool.
        ValueError: ``num_heads`` < 1; an initial value that is not positive and finite, or a sequence
            whose length is not H.

    Example:
        >>> bias = KerpleLogBias(1, init_r1=1.0, init_r2=1.0)
        >>> bias(1, 3).detach()  # -log(1 + d) for d = 2, 1, 0
        tensor([[[-1.0986, -0.6931, -0.0000]]])
    """

    _r1_high = 2.0
    _r2_high = 1.0

    def _kernel(self, r1: torch.Tensor, r2: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        return -r1 * torch.log1p(r2 * distance)


class KerplePowerBias(_KerpleBias):
    """KERPLE, power variant: ``PE_h(i, j) = -r1_h * |i - j| ** r2_h`` (Chi et al. 2022, §3-4).

    Two learnable scalars per head: r1 > 0 (``softplus``) and the exponent 0 < r2 < 2
    (``2 * sigmoid``; the paper allows r2 = 2, which this parametrisation approaches but never reaches).
    r2 = 1 with a fixed r1 is ALiBi. Score convention "additive" by default, as :class:`KerpleLogBias`;
    causal / bidirectional forms as there. The gradient at distance 0 is finite (``0 ** r2 = 0`` for
    every r2 > 0).

    Args:
        num_heads: number of heads H, >= 1.
        bidirectional: True (default, as every family: docs/conventions.md; equal to the causal form on
            past keys), False for the causal-only form.
        init_r1: initial r1, a number or one per head, > 0; default uniform in [0.01, 0.99] (the
            authors' code draws U(0, 1) and clamps at 0.01).
        init_r2: initial r2, a number or one per head, in (0, 2); default uniform in [0.01, 1.99]
            (U(0, 2), clamped to [0.01, 2]).

    Attributes:
        raw_r1, raw_r2: float32 parameters (H,); ``r1 = softplus(raw_r1)``, ``r2 = 2 * sigmoid(raw_r2)``.

    Raises:
        TypeError: ``num_heads`` not an int, ``bidirectional`` not a bool.
        ValueError: ``num_heads`` < 1; ``init_r1`` not positive and finite; ``init_r2`` outside (0, 2);
            a sequence whose length is not H.
    """

    _r1_high = 1.0
    _r2_high = 2.0
    _r2_bounded = True

    @staticmethod
    def _r2_inverse(r2: torch.Tensor) -> torch.Tensor:
        return torch.logit(r2 / 2)

    @property
    def r2(self) -> torch.Tensor:
        """Exponent r2 of each head, ``2 * sigmoid(raw_r2)`` in (0, 2): (H,) in the parameters' dtype."""
        return 2 * torch.sigmoid(self.raw_r2)

    def _kernel(self, r1: torch.Tensor, r2: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        return -r1 * distance.pow(r2)


# KERPLE sizes nothing by max_len (it extrapolates by construction); options go to the constructor
# (init_r1=, init_r2=).
register_family(
    "kerple_log",
    lambda *, num_heads, max_len, bidirectional, **o: KerpleLogBias(num_heads, bidirectional=bidirectional, **o),
)
register_family(
    "kerple_power",
    lambda *, num_heads, max_len, bidirectional, **o: KerplePowerBias(num_heads, bidirectional=bidirectional, **o),
)
