"""One learnable scalar per offset, ``PE(i, j) = u_{i-j}`` (Shaw et al. 2018, NAACL, §3)."""

from __future__ import annotations

import torch
from torch import nn

from .._int_args import check_int
from .registry import register_family
from .table import TableBias

__all__ = ["PerOffsetBias"]

_POLICIES = ("error", "clip")


class PerOffsetBias(TableBias):
    """Per-offset learnable bias ``PE(i, j) = u_{i-j}``, one scalar per offset (and per head, optionally).

    Sized by the longest training length ``max_len`` = L: causal attention sees offsets 0 .. L-1
    (L scalars), bidirectional attention -(L-1) .. L-1 (2L-1 scalars). Offsets outside the table have
    no parameter: by default asking for one raises; ``out_of_range="clip"`` reuses the parameter of the
    nearest trained offset (``u_{clip(i-j, -(L-1), L-1)}``), as Shaw et al. 2018 clip at distance k.
    A causal bias is 0 at future keys (offset < 0), which carry no parameter and must be masked.

    Score convention by default: "seed", ``((q.k) + u_{i-j}) * scale`` (docs/conventions.md).

    Every argument is keyword-only (docs/conventions.md, "Constructors"): in relbias a positional number is
    ``num_heads``, so ``PerOffsetBias(8)`` is refused rather than read as ``max_len=8``.

    Args:
        max_len: longest training length L in tokens, >= 1 (required).
        num_heads: 1 (default) for one table shared by all heads (the output broadcasts over heads),
            or H for one table per head.
        bidirectional: True (default) for offsets of both signs, False for causal attention.
        out_of_range: "error" (default) or "clip".
        init_std: standard deviation of the normal initialisation; 0.0 (default) starts at zeros,
            i.e. as attention without position bias.

    Attributes:
        weight: float32 parameter (num_offsets, num_heads); row ``offset`` (causal) or
            ``offset + L - 1`` (bidirectional).

    Raises:
        TypeError: a positional argument, a missing ``max_len``, non-int ``max_len`` / ``num_heads``.
        ValueError: ``max_len`` < 1, ``num_heads`` < 1, unknown ``out_of_range`` or negative
            ``init_std``; from :meth:`index`, an offset beyond the table with ``out_of_range="error"``.
    """

    default_convention = "seed"

    def __init__(
        self,
        *args: object,
        max_len: int | None = None,
        num_heads: int = 1,
        bidirectional: bool = True,
        out_of_range: str = "error",
        init_std: float = 0.0,
    ) -> None:
        super().__init__()
        if args:
            raise TypeError(
                f"PerOffsetBias takes keyword arguments only, got positional {args!r}: a positional number means "
                f"num_heads in relbias (T5Bias(8) has 8 heads), so pass the table length as max_len= "
                f"(e.g. PerOffsetBias(max_len={args[0]!r}, num_heads=1))"
            )
        if max_len is None:
            raise TypeError("PerOffsetBias needs max_len=, the longest training length L in tokens")
        check_int("max_len", max_len, minimum=1)
        check_int("num_heads", num_heads, minimum=1)
        if out_of_range not in _POLICIES:
            raise ValueError(f"out_of_range must be one of {_POLICIES}, got {out_of_range!r}")
        if not isinstance(bidirectional, bool):
            raise TypeError(f"bidirectional must be a bool, got {bidirectional!r}")
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std}")
        self.max_len = max_len
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        self.out_of_range = out_of_range
        rows = self.parameter_count(max_len, bidirectional=bidirectional)
        self.weight = nn.Parameter(torch.randn(rows, num_heads) * init_std)

    @staticmethod
    def parameter_count(max_len: int, *, bidirectional: bool, num_heads: int = 1) -> int:
        """Learnable scalars of a per-offset bias for training length ``max_len`` = L.

        Returns ``L * num_heads`` causal, ``(2L - 1) * num_heads`` bidirectional.

        Example:
            >>> PerOffsetBias.parameter_count(512, bidirectional=False), PerOffsetBias.parameter_count(512, bidirectional=True)
            (512, 1023)
        """
        return (2 * max_len - 1 if bidirectional else max_len) * num_heads

    @property
    def max_table_offset(self) -> int:
        """Largest offset with a parameter, L - 1 (the smallest is -(L-1), or 0 when causal)."""
        return self.max_len - 1

    def index(self, offsets: torch.Tensor) -> torch.Tensor:
        """Table row of each offset; -1 for future keys (offset < 0) of a causal bias.

        Raises:
            ValueError: with ``out_of_range="error"``, an offset with no parameter; the message names
                it and the largest trained offset.
        """
        low = -self.max_table_offset if self.bidirectional else 0
        if offsets.numel() and self.out_of_range == "error":
            too_far = offsets.abs() > self.max_table_offset
            if not self.bidirectional:
                too_far &= offsets > 0
            if bool(too_far.any()):
                worst = int(offsets[too_far].abs().max())
                worst = worst if bool((offsets == worst).any()) else -worst
                raise ValueError(
                    f"offset {worst} has no parameter: this per-offset bias was trained up to max_len="
                    f"{self.max_len}, so the largest offset it knows is {self.max_table_offset}. Pass "
                    f"out_of_range='clip' to reuse the parameter of offset "
                    f"{self.max_table_offset if worst > 0 else -self.max_table_offset} (Shaw et al. 2018), or use a "
                    f"family that extrapolates (e.g. T5Bias)"
                )
        rows = offsets.clamp(min=low, max=self.max_table_offset) - low
        if not self.bidirectional:
            rows = torch.where(offsets < 0, torch.full_like(rows, -1), rows)
        return rows

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        rows = self.index(offsets)
        values = self.weight[rows.clamp(min=0)].movedim(-1, 0)  # (H, *S)
        if not self.bidirectional:
            values = values.masked_fill(rows < 0, 0.0)  # future keys: no parameter, bias 0
        return values

    def causal_mismatch(self) -> str | None:
        if not self.bidirectional:
            return None
        return (
            f"PerOffsetBias(bidirectional=True) used with is_causal=True: the {self.max_len - 1} rows of future "
            f"offsets are never read or trained; pass bidirectional=False for a causal table of {self.max_len} rows"
        )

    def far_constant_distance(self) -> int | None:
        """Distance T (tokens) from which the bias is one constant per direction, or None.

        With ``out_of_range="clip"`` every offset with ``|i - j| >= L - 1`` reads the parameter of ``±(L - 1)``,
        so T = ``max_table_offset``; with ``"error"`` such offsets have no value and None is returned. Used by
        the structured backend.
        """
        return self.max_table_offset if self.out_of_range == "clip" else None

    def describe(self) -> dict[str, object]:
        """Constants: ``max_len`` (L, tokens), ``max_table_offset`` (L - 1) and ``out_of_range``."""
        return {"max_len": self.max_len, "max_table_offset": self.max_table_offset, "out_of_range": self.out_of_range}

    def extra_repr(self) -> str:
        return (
            f"max_len={self.max_len}, num_heads={self.num_heads}, bidirectional={self.bidirectional}, "
            f"out_of_range={self.out_of_range!r}"
        )


register_family(
    "offset",
    lambda *, num_heads, max_len, bidirectional, **o: PerOffsetBias(
        max_len=max_len, num_heads=num_heads, bidirectional=bidirectional, **o
    ),
)
