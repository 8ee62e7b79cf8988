"""Bias families by name, so that models, experiments and the CLI can pick one from a config string."""

from __future__ import annotations

import re
from typing import Callable

from .alibi import ALiBiBias
from .base import RelativeBias
from .fire import FIREBias
from .kerple import KerpleLogBias, KerplePowerBias
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
        ValueError: unknown family name, an option the family does not take; errors of the family's
            constructor.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown bias family {name!r}; known: {sorted(FAMILIES)}")
    try:
        return FAMILIES[name](num_heads=num_heads, max_len=max_len, bidirectional=bidirectional, **options)
    except TypeError as exc:
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if unexpected is None:
            raise
        raise ValueError(
            f"bias family {name!r} does not take option {unexpected.group(1)!r} (given {sorted(options)}); "
            f"see the family's class docstring (e.g. help(relbias.T5Bias)) for its keyword arguments"
        ) from exc


# NoPE ("no position encoding"): the explicit choice of no position bias at all; make_bias returns None
# and attention runs on the plain scores (Kazemnejad et al. 2023 study causal language models without it).
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
# ALiBi, KERPLE and FIRE do not size anything by max_len (they extrapolate by construction); options
# go to their constructors (e.g. init_r1=, init_r2= for KERPLE; hidden_width=, init_threshold= for FIRE).
register_family(
    "alibi",
    lambda *, num_heads, max_len, bidirectional: ALiBiBias(num_heads, bidirectional=bidirectional),
)
register_family(
    "kerple_log",
    lambda *, num_heads, max_len, bidirectional, **o: KerpleLogBias(num_heads, bidirectional=bidirectional, **o),
)
register_family(
    "kerple_power",
    lambda *, num_heads, max_len, bidirectional, **o: KerplePowerBias(num_heads, bidirectional=bidirectional, **o),
)
register_family(
    "fire",
    lambda *, num_heads, max_len, bidirectional, **o: FIREBias(num_heads, bidirectional=bidirectional, **o),
)
