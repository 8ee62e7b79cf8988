"""Attention backends. Each takes validated inputs and the same keyword arguments as
:func:`relbias.backends.reference.reference_attention`."""

from .reference import reference_attention

BACKENDS = {"reference": reference_attention}

__all__ = ["BACKENDS", "reference_attention"]
