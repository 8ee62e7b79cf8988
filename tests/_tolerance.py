"""How far apart two floating-point results of different code paths may be (not a test module).

Bit-equality (``torch.equal``) is asserted only where the same code path computes both sides: a repeated call, the
same seed, a copy / index / gather, integer or boolean results, a value computed exactly. Everywhere else (two
backends, two tilings, a contiguous and a strided layout, one thread and two, a sharded and an unsharded run) the
two sides are the same mathematics rounded differently, and :func:`assert_rounding_close` compares them within
:func:`rounding_tolerance`.
"""

from __future__ import annotations

import math

import torch

#: Default safety factor of :func:`rounding_tolerance` (see there).
MARGIN = 32.0


def _float_eps(*dtypes: torch.dtype) -> float:
    """eps of the least precise of ``dtypes`` (all floating point)."""
    for dtype in dtypes:
        if not dtype.is_floating_point:
            raise TypeError(f"a rounding tolerance is for floating-point results, not {dtype}: compare exactly")
    return max(torch.finfo(dtype).eps for dtype in dtypes)


def max_abs(t: torch.Tensor) -> float:
    """The largest finite |entry| of ``t`` (0.0 when it has none)."""
    finite = t.detach()[torch.isfinite(t.detach())]
    return finite.abs().max().item() if finite.numel() else 0.0


def rounding_tolerance(expected: torch.Tensor, *, n: int, dtype: torch.dtype | None = None,
                       scale: float | None = None, margin: float = MARGIN) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing two computations of ``expected`` that round differently.

    A sum of ``n`` terms rounds once per addition, each time by at most eps/2 of the partial sum (eps of ``dtype``,
    default ``expected``'s). Two code paths that sum in different orders (other tiles or blocks, another vector
    width or alignment, FMA contraction or not, per-thread partial sums, another backend's kernel) therefore differ
    by a sum of such errors; over a long sum they behave like random signs and grow as ``sqrt(n)``. The terms'
    magnitude is bounded by ``scale``, by default max |expected| over the whole tensor rather than entry by entry:
    an entry that is a sum cancelling to near zero (a weight's gradient summed over tokens) still carries the
    rounding of its large terms. Hence::

        rtol = margin * eps * sqrt(n),   atol = rtol * scale.

    ``n`` is the longest reduction the results go through (the head dim, the number of keys or queries, the tokens
    a parameter's gradient sums over). ``margin`` (32) covers the constant of the random-walk estimate, a few
    chained reductions (scores, softmax, the weighted sum of values, the backward's sums), exp / log
    implementations a few ulps apart and the other vector widths (scalar, AVX2, AVX-512). It stays far below a real
    error: float32 with n = 64 allows 3e-5 of the scale, float64 with n = 1000 2e-13, while a wrong mask, a missing
    term or a doubled reduction is off by a fraction of order 1 of the scale.
    """
    eps = _float_eps(dtype or expected.dtype)
    rtol = margin * eps * math.sqrt(max(int(n), 1))
    return rtol * (max_abs(expected) if scale is None else float(scale)), rtol


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, *, n: int, scale: float | None = None,
                          margin: float = MARGIN, msg=None, **kwargs) -> None:
    """``torch.testing.assert_close`` with the tolerance of :func:`rounding_tolerance` for the less precise of the
    two dtypes (both sides must have the same dtype unless ``check_dtype=False`` is passed)."""
    eps_dtype = actual.dtype if _float_eps(actual.dtype) >= _float_eps(expected.dtype) else expected.dtype
    atol, rtol = rounding_tolerance(expected, n=n, dtype=eps_dtype, scale=scale, margin=margin)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg, **kwargs)
