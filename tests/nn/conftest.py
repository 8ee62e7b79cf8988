"""Fixtures for the nn tests: every registered bias family, with non-trivial parameters."""

from __future__ import annotations

import pytest
import torch

from relbias.biases import make_bias


def _perturbed_bias(name: str, *, num_heads: int, max_len: int, bidirectional: bool = False, **options):
    """A bias of family ``name`` whose parameters are moved away from their initial values.

    Zero-initialised parameters (a per-offset table) would hide position errors, so they are drawn
    from N(0, 0.5); other parameters are scaled by a factor in [1, 1.5], which keeps their sign (some
    families need positive parameters).
    """
    bias = make_bias(name, num_heads=num_heads, max_len=max_len, bidirectional=bidirectional, **options)
    if bias is not None:
        with torch.no_grad():
            for p in bias.parameters():
                if bool((p == 0).all()):
                    p.normal_(0.0, 0.5)
                else:
                    p.mul_(1.0 + 0.5 * torch.rand_like(p))
    return bias


@pytest.fixture
def perturbed_bias():
    """The function :func:`_perturbed_bias`."""
    return _perturbed_bias

