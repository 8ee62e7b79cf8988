"""Bias families by name, so that models, experiments and the CLI can pick one from a config string."""

from __future__ import annotations

from typing import Callable

from .base import RelativeBias
from .offset import PerOffsetBias
from .t5 import T5Bias

__all__ = ["FAMILIES", "make_bias", "register_family"]

#: name -> factory(num_heads, max_len, bidirectional, **options) -> RelativeBias or None ("none": NoPE).
FAMILIES: dict[str, Callable[..., RelativeBias | None]] = {}


def register_family(name: str, factory: Callable[..., RelativeBias | None]) -> None:
    """Register ``factory(*, num_heads, max_len, bidirectional, **options)`` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    if name in FAMILIES:
        raise ValueError(f"bias family {name!r} is already registered")
    FAMILIES[name] = factory


def make_bias(
    name: str, *, num_heads: int, max_len: int, bidirectional: bool, **options: object
) -> RelativeBias | None:
    """Build a bias module of family ``name``; ``None`` for ``"none"`` (no position bias, NoPE).

    Args:
        name: a key of :data:`FAMILIES` ("none", "offset", "t5", ...).
        num_heads: H.
        max_len: longest training length in tokens (sizes per-offset tables; others may ignore it).
        bidirectional: False for causal attention.
        **options: family-specific keyword arguments (e.g. ``out_of_range="clip"``, ``num_buckets``).

    Raises:
        ValueError: unknown family name; errors of the family's constructor.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown bias family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name](num_heads=num_heads, max_len=max_len, bidirectional=bidirectional, **options)


register_family("none", lambda *, num_heads, max_len, bidirectional: None)
register_family(
    "offset",
    lambda *, num_heads, max_len, bidirectional, **o: PerOffsetBias(
        max_len, num_heads=num_heads, bidirectional=bidirectional, **o
    ),
)
register_family(
    "t5",
    lambda *, num_heads, max_len, bidirectional, **o: T5Bias(num_heads, bidirectional=bidirectional, **o),
)
