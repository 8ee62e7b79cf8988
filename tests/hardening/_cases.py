"""Shared builders for the hardening tests of the backends (not a test module)."""

from __future__ import annotations

import re

import pytest
import torch

import relbias
from relbias.backends import BACKENDS
from relbias.biases import FAMILIES, make_bias
from relbias.dispatch import explain_backend

from .._markers import triton_runs_on_cpu

#: Every registered family, plus variants that let the structured backend split off far parts at small
#: lengths (T5 with few buckets, a clipped per-offset table).
FAMILY_CASES = sorted(FAMILIES) + ["t5_small", "offset_clip"]
#: Every registered backend but the oracle, in priority order.
FAST_BACKENDS = [name for name in BACKENDS if name != "reference" and (name != "triton" or triton_runs_on_cpu())]


def build_bias(name: str, *, num_heads: int, bidirectional: bool, max_len: int = 16):
    """A bias of family ``name`` with parameters moved away from their initial values; None for "none"."""
    if name == "t5_small":
        bias = relbias.T5Bias(num_heads, num_buckets=8, max_distance=16, bidirectional=bidirectional)
    elif name == "offset_clip":
        bias = relbias.PerOffsetBias(max_len=4, num_heads=num_heads, bidirectional=bidirectional, out_of_range="clip")
    elif name == "offset":
        bias = make_bias(name, num_heads=num_heads, max_len=max_len, bidirectional=bidirectional, out_of_range="clip")
    else:
        bias = make_bias(name, num_heads=num_heads, max_len=max_len, bidirectional=bidirectional)
    if bias is not None:
        with torch.no_grad():
            for p in bias.parameters():
                p.mul_(1.0 + 0.5 * torch.rand_like(p)).add_(0.3 * torch.randn_like(p) * (p == 0))
    return bias


def call_or_refusal(backend, *args, **kwargs):
    """``relbias.attention(..., backend=backend)`` or, when the named backend refuses, the refusal's reason.

    A refusal must be a ValueError of the form "backend 'NAME' cannot run this call: REASON" with a
    non-empty reason, and :func:`relbias.explain_backend` must give the same one without running anything.
    """
    try:
        return relbias.attention(*args, backend=backend, **kwargs)
    except ValueError as exc:
        match = re.fullmatch(rf"backend '{backend}' cannot run this call: (.{{10,}})", str(exc))
        if match is None:
            raise
        explain = {k: v for k, v in kwargs.items() if k not in ("scale", "convention")}
        with pytest.raises(ValueError) as again:
            explain_backend(*args, backend=backend, **explain)
        assert str(again.value) == str(exc)
        return match.group(1)
