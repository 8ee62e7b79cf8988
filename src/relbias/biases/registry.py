"""Bias families by name, so that models, experiments and the CLI can pick one from a config string.

Each family module registers itself at import (``register_family(...)`` at its end); importing
:mod:`relbias.biases` imports them all, in the order of :data:`FAMILIES`.
"""

from __future__ import annotations

import re
from typing import Callable

from .base import RelativeBias

__all__ = ["FAMILIES", "make_bias", "register_family"]

#: name -> factory(num_heads, max_len, bidirectional, **options) -> RelativeBias or None ("none": NoPE),
#: in registration order: none, offset, t5, alibi, kerple_log, kerple_power, fire, then any added later
#: (``relbias extrapolate`` runs them in this order by default).
FAMILIES: dict[str, Callable[..., RelativeBias | None]] = {}


def register_family(name: str, factory: Callable[..., RelativeBias | None]) -> None:
    """Register ``factory(*, num_heads, max_len, bidirectional, **options)`` under ``name``.

    Args:
        name: the family's config name, a new key of :data:`FAMILIES` (appended, so it comes last).
        factory: called by :func:`make_bias` with keyword arguments only: ``num_heads`` (H, int),
            ``max_len`` (longest training length, tokens; a family that sizes nothing by it ignores it),
            ``bidirectional`` (bool) and the caller's family options; returns a :class:`RelativeBias`
            (or None for no bias).

    Example:
        At the end of the family's own module (see ``relbias/biases/alibi.py``)::

            register_family(
                "my_family",
                lambda *, num_heads, max_len, bidirectional: MyBias(num_heads, bidirectional=bidirectional),
            )

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
