"""ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long", ICLR, §3)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._int_args import check_int
from .base import RelativeBias
from .registry import register_family

__all__ = ["ALiBiBias", "alibi_slopes", "mpt_alibi_slopes"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The per-head ALiBi slopes ``m_h`` of Press et al. 2022 (ICLR, §3).

    For a power of two ``n`` the slopes are the geometric sequence ``2^(-8k/n)``, k = 1 .. n (8 heads:
    1/2, 1/4, ..., 1/256). For other head counts the paper's reference rule is used: the ``p`` slopes of
    the closest power of two below (``p = 2^floor(log2 n)``), followed by every other slope of ``2p``
    heads (the 1st, 3rd, 5th, ...) until there are ``n``. For 6 heads: 1/4, 1/16, 1/64, 1/256, 1/2, 1/8;
    for 12 heads: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.

    Args:
        num_heads: number of heads H, >= 1.

    Returns:
        float64 tensor (H,), slopes in logits per token of distance, all in (0, 1).

    Raises:
        TypeError: ``num_heads`` is not an int (bools are rejected).
        ValueError: ``num_heads`` < 1.

    Example:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    check_int("num_heads", num_heads, minimum=1)

    def geometric(n: int) -> list[float]:  # n a power of two
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    power = 1 << (num_heads.bit_length() - 1)  # closest power of two <= num_heads
    slopes = geometric(power)
    if power != num_heads:
        slopes += geometric(2 * power)[0::2][: num_heads - power]
    return torch.tensor(slopes, dtype=torch.float64)


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """The per-head slopes of MosaicML's MPT (``attn_config.alibi_bias_max``), in MPT's head order.

    With ``P`` the power of two >= ``num_heads``, the ``P`` slopes ``2^(-alibi_bias_max * k / P)``, k = 1 .. P;
    for a power of two that is all of them. Otherwise MPT takes the even-numbered ones (the 2nd, 4th, ...) then
    the odd-numbered ones (1st, 3rd, ...) and keeps the first ``num_heads``. With ``alibi_bias_max=8`` that is
    :func:`alibi_slopes` for every head count (the two rules order the slopes alike); other values scale the
    exponents. Computed in float32 as MPT's ``build_alibi_bias`` (llm-foundry; transformers'
    ``build_mpt_alibi_tensor``) does, so that the values are MPT's bit for bit.

    Args:
        num_heads: number of heads H, >= 1.
        alibi_bias_max: the largest exponent, > 0 (MPT's default 8: the smallest slope of P heads is 2^-8).

    Returns:
        float32 tensor (H,), slopes in logits per token of distance.

    Raises:
        TypeError: ``num_heads`` is not an int (bools are rejected), ``alibi_bias_max`` not a real number.
        ValueError: ``num_heads`` < 1, ``alibi_bias_max`` not finite and > 0.

    Example:
        >>> mpt_alibi_slopes(6).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    """
    check_int("num_heads", num_heads, minimum=1)
    if isinstance(alibi_bias_max, bool) or not isinstance(alibi_bias_max, (int, float)):
        raise TypeError(f"alibi_bias_max must be a real number, got {alibi_bias_max!r}")
    if not (math.isfinite(alibi_bias_max) and alibi_bias_max > 0):
        raise ValueError(f"alibi_bias_max must be finite and > 0, got {alibi_bias_max}")
    power = 1 << (num_heads - 1).bit_length()  # the power of two >= num_heads
    exponents = torch.arange(1, power + 1, dtype=torch.int64).float() * (alibi_bias_max / power)
    slopes = 1.0 / torch.pow(2, exponents)
    if power != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[0::2]])[:num_heads]
    return slopes


class ALiBiBias(RelativeBias):
    """ALiBi, a fixed linear penalty on distance: ``PE_h(i, j) = -m_h * (i - j)`` for past keys.

    ``m_h`` are :func:`alibi_slopes` unless ``slopes`` gives them (a model's own rule: BLOOM's and Falcon's are
    :func:`alibi_slopes`, computed in float32, Falcon's then rounded to bfloat16; MPT's :func:`mpt_alibi_slopes`).
    Nothing is learned. Used with the additive score convention,
    ``(q.k) * scale + PE + Mask`` (Press et al. 2022, §3: the bias is added after the query-key product
    is scaled), which is this module's ``default_convention``.

    Causal (``bidirectional=False``, the paper's setting): defined for past keys,
    ``-m_h * (i - j)`` for ``i - j >= 0``; future keys (offset < 0) get 0 and must be masked.

    Bidirectional (``bidirectional=True``, not in the paper; our definition): the symmetric penalty
    ``-m_h * |i - j|``, so a key at distance d before or after the query is penalised alike.

    Args:
        num_heads: number of heads H, >= 1; head ``h`` uses slope ``alibi_slopes(H)[h]`` (or ``slopes[h]``).
        bidirectional: True (default, as every family: docs/conventions.md) for the symmetric form, which
            equals the causal one on past keys; False for the causal-only form.
        slopes: None (default: :func:`alibi_slopes`), or the H slopes, logits per token of distance, finite and
            >= 0: a 1-D float tensor (any device; stored as float32 on this module's device, rounded as
            ``.float()`` rounds) or a sequence of numbers.

    Attributes:
        slopes: float32 non-persistent buffer (H,), the slopes (derived or given, so not in the state_dict).

    Raises:
        TypeError: ``num_heads`` is not an int, ``bidirectional`` not a bool, ``slopes`` neither a tensor nor a
            sequence of real numbers, or a tensor that is not floating point.
        ValueError: ``num_heads`` < 1; ``slopes`` not of shape (num_heads,), or with a value that is not finite
            and >= 0.

    Example:
        >>> from relbias import ALiBiBias
        >>> ALiBiBias(2)(3, 3)[1]  # head 1, slope 1/256: -slope * |i - j|
        tensor([[ 0.0000, -0.0039, -0.0078],
                [-0.0039,  0.0000, -0.0039],
                [-0.0078, -0.0039,  0.0000]])
        >>> ALiBiBias(2, bidirectional=False)(3, 3)[1]  # causal (the paper's): future keys 0, masked anyway
        tensor([[ 0.0000,  0.0000,  0.0000],
                [-0.0039,  0.0000,  0.0000],
                [-0.0078, -0.0039,  0.0000]])
    """

    state_only = True  # values read the parameters (and buffers) only

    default_convention = "additive"
    distance_only = True

    def __init__(
        self, num_heads: int, *, bidirectional: bool = True, slopes: torch.Tensor | Sequence[float] | None = None
    ) -> None:
        super().__init__()
        check_int("num_heads", num_heads, minimum=1)
        if not isinstance(bidirectional, bool):
            raise TypeError(f"bidirectional must be a bool, got {bidirectional!r}")
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        values = alibi_slopes(num_heads) if slopes is None else _checked_slopes(slopes, num_heads)
        self.register_buffer("slopes", values.detach().float().clone(), persistent=False)

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        """``-m_h * |offset|`` (bidirectional) or ``-m_h * max(offset, 0)`` (causal): float ``(H, *S)``, logits."""
        distance = self.distance(offsets)
        slopes = self.slopes.reshape(-1, *([1] * offsets.dim()))  # (H, 1, ..., 1)
        return slopes * (-distance).to(self.slopes.dtype)  # -m_h * distance, without -0.0

    def describe(self) -> dict[str, object]:
        """Constants: ``slopes``, the H slopes ``m_h`` (logits per token of distance)."""
        return {"slopes": self.slopes.tolist()}

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, bidirectional={self.bidirectional}"


def _checked_slopes(slopes: torch.Tensor | Sequence[float], num_heads: int) -> torch.Tensor:
    """``slopes`` as a float tensor (num_heads,), finite and >= 0, or the error that says what is wrong."""
    if not isinstance(slopes, torch.Tensor):
        if isinstance(slopes, (str, bytes)) or not isinstance(slopes, Sequence) or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) for s in slopes
        ):
            raise TypeError(f"slopes must be a float tensor or a sequence of real numbers, got {slopes!r}")
        slopes = torch.tensor([float(s) for s in slopes], dtype=torch.float64)
    elif not slopes.is_floating_point():
        raise TypeError(f"slopes must be a floating-point tensor, got dtype {slopes.dtype}")
    if tuple(slopes.shape) != (num_heads,):
        raise ValueError(f"slopes must have shape ({num_heads},) (one per head), got {tuple(slopes.shape)}")
    bad = ~(torch.isfinite(slopes) & (slopes >= 0))
    if bool(bad.any()):
        head = int(bad.nonzero()[0, 0])
        raise ValueError(f"slopes must be finite and >= 0; slopes[{head}] = {slopes[head].item()}")
    return slopes


# ALiBi sizes nothing by max_len: it extrapolates by construction.
register_family(
    "alibi",
    lambda *, num_heads, max_len, bidirectional: ALiBiBias(num_heads, bidirectional=bidirectional),
)
