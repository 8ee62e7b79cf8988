"""The benchmark engine (relbias.benchmark) on fake clocks and load averages: no real kernel is timed."""

from __future__ import annotations

import pytest

from relbias import benchmark
from relbias.backends import BACKENDS


class FakeClock:
    """A clock that each step advances by the step's next duration (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def step(self, durations):
        it = iter(durations)

        def run():
            self.now += next(it)
        return run


def test_method_names_come_from_the_registry():
    assert benchmark.method_names() == ["sdpa", "sdpa_bias", "eager", *BACKENDS]
    assert "reference" in benchmark.method_names() and "reference" not in benchmark.default_methods()
    assert "flex" not in benchmark.default_methods()
    assert {"structured", "blockwise"} <= set(benchmark.default_methods())


def test_warmup_and_repeats_scale_with_the_size():
    assert [benchmark.warmup_rounds(n) for n in (16, 256, 512, 1024, 8192)] == [5, 4, 2, 1, 1]
    assert benchmark.timed_rounds(10.0, repeats=3, budget_ms=500, max_repeats=100) == 50
    assert benchmark.timed_rounds(10.0 - 1e-12, repeats=3, budget_ms=500, max_repeats=100) == 50  # clock rounding
    assert benchmark.timed_rounds(0.1, repeats=3, budget_ms=500, max_repeats=100) == 100  # capped
    assert benchmark.timed_rounds(900.0, repeats=3, budget_ms=500, max_repeats=100) == 3  # --repeats is the floor
    assert benchmark.timed_rounds(1.0, repeats=7, budget_ms=0, max_repeats=2) == 7
    assert benchmark.timed_rounds(0.0, repeats=3, budget_ms=500, max_repeats=100) == 100


def test_time_methods_reports_minimum_and_median_round_robin():
    clock, order = FakeClock(), []
    # a: warm-up 0.1 s (dropped), then 4 ms, 2 ms, 9 ms -> min 2, median 4; b: 1 s warm-up, then 1, 3, 2 ms
    a, b = clock.step([0.1, 0.004, 0.002, 0.009]), clock.step([1.0, 0.001, 0.003, 0.002])
    steps = {"a": lambda: (order.append("a"), a()), "b": lambda: (order.append("b"), b())}
    got = benchmark.time_methods(steps, warmup=1, repeats=3, budget_ms=1.0, max_repeats=50, clock=clock)
    assert got["a"] == pytest.approx({"ms": 2.0, "median_ms": 4.0, "repeats": 3, "warmup": 1})
    assert got["b"] == pytest.approx({"ms": 1.0, "median_ms": 2.0, "repeats": 3, "warmup": 1})
    assert order == ["a", "b"] * 4


def test_time_methods_fills_the_budget_from_the_slowest_warmup_and_reports_errors():
    clock = FakeClock()
    # ~1 ms and 7.8125 ms (exact in binary); slow's first warm-up call (1 s) is not what the rounds scale to
    fast, slow = clock.step([2.0**-10] * 100), clock.step([1.0] + [2.0**-7] * 100)
    calls_after = []

    def broken():
        raise RuntimeError("not supported\nsecond line")
    got = benchmark.time_methods({"fast": fast, "slow": slow, "broken": broken}, warmup=2, repeats=3,
                                 budget_ms=100.0, max_repeats=50, clock=clock, after=lambda: calls_after.append(1))
    assert got["fast"]["repeats"] == got["slow"]["repeats"] == 13  # ceil(100 ms / 7.8125 ms)
    assert got["slow"]["median_ms"] == 7.8125 and got["fast"]["ms"] == 1000 / 1024
    assert got["broken"] == {"error": "RuntimeError: not supported"}
    assert len(calls_after) == 2 * 2 + 1 + 13 * 2  # every call, the failing one included


def _load(load_1min, cpu_s, wall_s):
    return {"load_1min": load_1min, "cpu_s": cpu_s, "wall_s": wall_s}


def test_busy_warning_from_the_load_average(monkeypatch):
    monkeypatch.setattr(benchmark.os, "getloadavg", lambda: (3.25, 2.0, 1.0))
    sample = benchmark.load_sample()
    assert sample["load_1min"] == 3.25 and sample["cpu_s"] >= 0
    warning = benchmark.busy_warning(sample, {**sample, "wall_s": sample["wall_s"] + 10}, cores=2)
    assert warning.startswith("WARNING: machine busy") and "3.25 before" in warning and "threshold 1.5" in warning
    # after the run, this process's own CPU use (here 2 CPUs for 60 s) is not counted as load from others
    assert benchmark.busy_warning(_load(0.2, 0, 0), _load(2.3, 120, 60), cores=2) is None
    assert "0.50 CPUs" in benchmark.busy_warning(_load(0.2, 0, 0), _load(2.3, 30, 60), cores=2)
    assert benchmark.busy_warning(_load(1.4, 0, 0), _load(1.4, 0, 60), cores=2) is None


def test_spread_warning_names_the_unstable_configurations():
    rows = [dict(n=256, causal=False, mode="fwd", method="structured", ms=9.4, median_ms=544.0),
            dict(n=256, causal=False, mode="fwd", method="sdpa", ms=1.0, median_ms=1.1),
            dict(n=512, causal=True, mode="fwdbwd", method="sdpa", ms=1.0, median_ms=1.9),
            dict(n=512, causal=True, mode="fwdbwd", method="eager", error="skipped")]
    assert "at N=256 bidi fwd:" in benchmark.spread_warning(rows)
    assert benchmark.spread_warning(rows[1:]) is None
