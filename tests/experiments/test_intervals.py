"""Student-t critical values and the mean's interval against hand computations."""

from __future__ import annotations

import math

import pytest

from relbias.experiments.intervals import mean_interval, t_quantile


def test_t_quantiles_match_their_closed_forms_and_the_table():
    # df = 1 (Cauchy): P(|T| < t) = 2 atan(t) / pi, so t = tan(0.95 pi / 2).
    assert t_quantile(1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-10)
    # df = 2: P(|T| < t) = t / sqrt(2 + t^2), so t = sqrt(2 c^2 / (1 - c^2)) with c = 0.95.
    assert t_quantile(2) == pytest.approx(math.sqrt(2 * 0.95**2 / (1 - 0.95**2)), rel=1e-10)
    # Printed tables (e.g. Abramowitz & Stegun Table 26.10): 3.182, 2.776, 2.228, 2.042; 1.960 in the limit.
    for df, value in ((3, 3.18245), (4, 2.77645), (10, 2.22814), (30, 2.04227)):
        assert t_quantile(df) == pytest.approx(value, abs=1e-5)
    assert 1.96 < t_quantile(2000) < 1.962
    # 90% two-sided for df = 2: t = sqrt(2 * 0.9^2 / (1 - 0.9^2)) = 2.91999.
    assert t_quantile(2, 0.9) == pytest.approx(math.sqrt(2 * 0.81 / 0.19), rel=1e-10)


def test_mean_interval_of_three_seeds_by_hand():
    # values 1, 2, 3: mean 2, sample std 1, half-width t_{0.975, 2} / sqrt(3) = 4.302653 / 1.732051 = 2.484138.
    stat = mean_interval([1.0, 2.0, 3.0])
    assert stat["mean"] == 2.0 and stat["std"] == pytest.approx(1.0) and stat["n"] == 3
    assert stat["half_width"] == pytest.approx(2.484138, abs=1e-6)
    assert stat["low"] == pytest.approx(2.0 - 2.484138, abs=1e-6)
    assert stat["high"] == pytest.approx(2.0 + 2.484138, abs=1e-6)


def test_one_seed_has_no_interval_and_bad_input_is_named():
    assert mean_interval([2.5]) == {"mean": 2.5, "std": None, "half_width": None, "low": None, "high": None, "n": 1}
    with pytest.raises(ValueError, match=r"at least one finite number, got \[\]"):
        mean_interval([])
    with pytest.raises(ValueError, match=r"got \[1.0, nan\]"):
        mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="degrees of freedom must be an int >= 1, got 0"):
        t_quantile(0)
    with pytest.raises(ValueError, match=r"coverage must be in \(0, 1\), got 1.5"):
        t_quantile(3, 1.5)
