"""95% confidence intervals on a mean across seeds: Student's t (Student 1908; Abramowitz & Stegun 1964, 26.7)."""

from __future__ import annotations

import math

__all__ = ["t_quantile", "mean_interval"]


def _t_two_sided_coverage(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` degrees of freedom, closed form for integer df
    (Abramowitz & Stegun 1964, 26.7.3 for odd df, 26.7.4 for even df), theta = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... up to cos^(df-2))
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    # 2/pi * (theta + sin(theta) * (cos + 2/3 cos^3 + (2*4)/(3*5) cos^5 + ... up to cos^(df-2)))
    if df == 1:
        return 2.0 * theta / math.pi
    c = math.cos(theta)
    term = total = c
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2.0 / math.pi * (theta + s * total)


def t_quantile(df: int, coverage: float = 0.95) -> float:
    """The two-sided Student-t critical value: t with P(|T| < t) = ``coverage``, T ~ t(``df``).

    That is the ``(1 + coverage) / 2`` quantile, e.g. 12.706 for df = 1, 4.303 for df = 2, 1.960 as df grows.
    Solved by bisection on the closed-form distribution function for integer df (Abramowitz & Stegun 26.7.3-4),
    to 1e-12 relative; no SciPy needed.

    Args:
        df: degrees of freedom, an int >= 1 (n - 1 for a mean of n values).
        coverage: in (0, 1). Default 0.95.

    Raises:
        ValueError: ``df`` not an int >= 1; ``coverage`` outside (0, 1).
    """
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an int >= 1, got {df!r}")
    if not 0.0 < coverage < 1.0:
        raise ValueError(f"coverage must be in (0, 1), got {coverage!r}")
    low, high = 0.0, 1.0
    while _t_two_sided_coverage(high, df) < coverage:
        high *= 2.0
    while high - low > 1e-12 * high:
        mid = 0.5 * (low + high)
        if _t_two_sided_coverage(mid, df) < coverage:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def mean_interval(values: list[float], coverage: float = 0.95) -> dict:
    """Mean of ``values`` (one per seed) and its Student-t confidence interval.

    ``half_width = t_quantile(n - 1, coverage) * s / sqrt(n)``, s the sample standard deviation (divisor n - 1):
    the interval for the mean of the distribution the seeds are drawn from, assuming the per-seed values are
    independent and roughly normal. With one value there is no interval (``low``, ``high``, ``half_width`` None).

    Args:
        values: floats (any unit; the result is in the same unit), at least one, all finite.
        coverage: in (0, 1). Default 0.95.

    Returns:
        ``{"mean", "std", "half_width", "low", "high", "n"}``; ``std`` is None for one value too.

    Raises:
        ValueError: no values, or a value that is not a finite number.
    """
    values = list(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
        raise ValueError(f"mean_interval needs at least one finite number, got {values!r}")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return {"mean": mean, "std": None, "half_width": None, "low": None, "high": None, "n": 1}
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1, coverage) * std / math.sqrt(n)
    return {"mean": mean, "std": std, "half_width": half, "low": mean - half, "high": mean + half, "n": n}
