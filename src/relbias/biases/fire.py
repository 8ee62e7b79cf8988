"""FIRE: functional interpolation for relative positions (Li et al. 2023, "Functional Interpolation for
Relative Positions Improves Long Context Transformers", ICLR 2024, §3)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .._int_args import check_int
from .base import RelativeBias
from .registry import register_family

__all__ = ["FIREBias"]


def _check_positions(name: str, positions: object) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(positions).__name__}")
    if positions.dim() != 1:
        raise ValueError(f"{name} must be 1-D (positions in tokens), got shape {tuple(positions.shape)}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (positions are whole tokens), got {positions.dtype}")
    return positions.long()


class FIREBias(RelativeBias):
    """FIRE: ``PE(i, j) = f_theta( psi(i - j) / psi(max(L, i)) )`` with ``psi(x) = log(c x + 1)``.

    ``i`` is the absolute query position and ``j`` the key position (tokens). ``f_theta`` is an MLP
    ``1 -> hidden_width -> H`` with a ReLU, giving one value per head; ``c > 0`` and the threshold
    ``L > 0`` (tokens) are learnable scalars shared by the heads (Li et al. 2023, §3: the log
    transform sharpens short distances; normalising by the query position, "progressive
    interpolation", keeps the MLP's input in [0, 1] at any length; the threshold L keeps short
    prefixes from being stretched). Because the bias reads the query position, not only ``i - j``,
    ``offset_only`` is False: :meth:`relbias.RelativeBias.native` raises and backends call :meth:`pair_values`.

    Positivity: ``c = exp(log_c)`` and ``L = exp(log_threshold)``. Defaults c = 0.1, L = 512 tokens and
    width 32 follow common public implementations of FIRE (the paper leaves them to training); the MLP starts with PyTorch's default
    ``nn.Linear`` initialisation. ``eps`` is added to ``psi(max(L, i))`` so that a threshold shrinking
    towards 0 cannot divide by 0.

    Causal (``bidirectional=False``, the paper's setting): past keys (``i - j >= 0``) as above;
    future keys get 0 and must be masked. Bidirectional (not in the paper; our definition): the MLP
    reads the signed input ``sign(i - j) * psi(|i - j|) / psi(max(L, i))``, so a key d tokens ahead
    and one d tokens behind get different values from the same function.

    Used with the additive score convention ``(q.k) * scale + PE + Mask`` (the paper adds the bias to
    the scaled logits), this module's ``default_convention``.

    Args:
        num_heads: number of heads H, >= 1 (the MLP's output width).
        bidirectional: True (default, as every family: docs/conventions.md; equal to the causal form on
            past keys), False for the causal-only form.
        hidden_width: width of the MLP's hidden layer, >= 1 (default 32).
        init_c: initial c, > 0 (default 0.1).
        init_threshold: initial threshold L in tokens, > 0 (default 512).
        eps: added to the normaliser, >= 0 (default 1e-6).

    Attributes:
        mlp: ``nn.Sequential(Linear(1, W), ReLU(), Linear(W, H))``.
        log_c, log_threshold: float32 scalar parameters.

    Raises:
        TypeError: ``num_heads`` / ``hidden_width`` not an int, ``bidirectional`` not a bool.
        ValueError: ``num_heads`` or ``hidden_width`` < 1; ``init_c``, ``init_threshold`` not positive
            and finite; negative ``eps``.
    """

    default_convention = "additive"
    offset_only = False

    def __init__(
        self,
        num_heads: int,
        *,
        bidirectional: bool = True,
        hidden_width: int = 32,
        init_c: float = 0.1,
        init_threshold: float = 512.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        check_int("num_heads", num_heads, minimum=1)
        check_int("hidden_width", hidden_width, minimum=1)
        if not isinstance(bidirectional, bool):
            raise TypeError(f"bidirectional must be a bool, got {bidirectional!r}")
        for name, value in (("init_c", init_c), ("init_threshold", init_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        self.hidden_width = hidden_width
        self.eps = float(eps)
        self.mlp = nn.Sequential(nn.Linear(1, hidden_width), nn.ReLU(), nn.Linear(hidden_width, num_heads))
        self.log_c = nn.Parameter(torch.tensor(math.log(init_c)))
        self.log_threshold = nn.Parameter(torch.tensor(math.log(init_threshold)))

    @property
    def c(self) -> torch.Tensor:
        """The log-transform's scale c = exp(log_c) > 0: scalar tensor."""
        return self.log_c.exp()

    @property
    def threshold(self) -> torch.Tensor:
        """The threshold L = exp(log_threshold) > 0, tokens: scalar tensor."""
        return self.log_threshold.exp()

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        """Not available: FIRE depends on the query position too.

        Raises:
            NotImplementedError: always; use :meth:`pair_values` or ``forward``.
        """
        raise NotImplementedError(
            "FIREBias depends on the absolute query position (it normalises by psi(max(L, i))), not on "
            "i - j alone; use pair_values(query_positions, key_positions) or forward(query_len, key_len)"
        )

    def normalized_input(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The MLP's input for every (query, key) pair: float (Tq, Tk) in the parameters' dtype.

        ``psi(i - j) / (psi(max(L, i)) + eps)`` causal (0 at future keys), or
        ``sign(i - j) psi(|i - j|) / (psi(max(L, i)) + eps)`` bidirectional; ``psi(x) = log(1 + c x)``.

        Args:
            query_positions: int64 (Tq,), absolute query positions in tokens.
            key_positions: int64 (Tk,), absolute key positions in tokens.

        Raises:
            TypeError: non-tensor or non-integer positions.
            ValueError: positions that are not 1-D.
        """
        query_positions = _check_positions("query_positions", query_positions)
        key_positions = _check_positions("key_positions", key_positions)
        dtype = self.log_c.dtype
        c = self.c
        offsets = query_positions[:, None] - key_positions[None, :]  # (Tq, Tk), i - j
        distance = self.distance(offsets)
        numerator = torch.log1p(c * distance.to(dtype))
        if self.bidirectional:
            numerator = numerator * offsets.sign().to(dtype)
        normaliser = torch.log1p(c * torch.maximum(query_positions.to(dtype), self.threshold)) + self.eps  # (Tq,)
        return numerator / normaliser[:, None]

    def pair_values(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Bias of every (query, key) pair: float (H, Tq, Tk), logits; 0 at future keys when causal.

        Args and errors as :meth:`normalized_input`.
        """
        x = self.normalized_input(query_positions, key_positions)  # (Tq, Tk)
        values = self.mlp(x.unsqueeze(-1)).movedim(-1, 0)  # (Tq, Tk, 1) -> (Tq, Tk, H) -> (H, Tq, Tk)
        if not self.bidirectional:
            future = (query_positions[:, None] - key_positions[None, :]) < 0
            values = values.masked_fill(future, 0.0)
        return values

    def pairs_sharing(self, query: int, key: int, length: int) -> torch.Tensor:
        """Pairs of a ``length``-token sequence whose bias equals that of ``(query, key)`` by construction.

        Two pairs read the same MLP input when their offsets are equal and their queries share the
        normaliser ``psi(max(L, i))``, i.e. both queries sit at or below the threshold L (or they are the
        same query). Every pair reads the same MLP parameters. Errors and result as
        :meth:`RelativeBias.pairs_sharing`.
        """
        same_offset = super().pairs_sharing(query, key, length)  # the default key is the offset itself
        with torch.no_grad():
            level = torch.maximum(same_offset[:, 0].to(self.log_threshold.dtype), self.threshold)
            mine = torch.maximum(level.new_tensor(float(query)), self.threshold)
        return same_offset[level == mine]

    def describe(self) -> dict[str, object]:
        """Constants: ``c`` and ``threshold`` (L, tokens) at their current values, ``hidden_width``, ``eps``.

        :attr:`relbias.RelativeBias.num_parameters` is the MLP's ``2 W + W H + H`` (W = hidden_width) plus c and L.
        """
        with torch.no_grad():
            c, threshold = float(self.c), float(self.threshold)
        return {"c": c, "threshold": threshold, "hidden_width": self.hidden_width, "eps": self.eps}

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, bidirectional={self.bidirectional}, hidden_width={self.hidden_width}"


# FIRE sizes nothing by max_len (progressive interpolation normalises by the query position); options go
# to the constructor (hidden_width=, init_c=, init_threshold=, eps=).
register_family(
    "fire",
    lambda *, num_heads, max_len, bidirectional, **o: FIREBias(num_heads, bidirectional=bidirectional, **o),
)
