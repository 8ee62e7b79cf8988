"""``relbias bench``: the table and the JSON carry every method with ratios to SDPA measured in the same run."""

from __future__ import annotations

import json

import pytest

from relbias import benchmark
from relbias.benchmark import memory
from relbias.cli.main import main


def test_bench_writes_every_method_with_ratios(tmp_path, capsys):
    path = tmp_path / "bench.json"
    status = main(["bench", "--n", "64", "--causal", "causal", "--mode", "both", "--repeats", "1", "--no-memory",
                   "--heads", "2", "--head-dim", "16", "--budget-ms", "0", "--json", str(path)])
    assert status == 0
    rows = json.loads(path.read_text())["rows"]
    methods = {(r["mode"], r["method"]) for r in rows if "ms" in r}
    for mode in ("fwd", "fwdbwd"):
        for method in ("sdpa", "sdpa_bias", "eager", "structured", "blockwise"):
            assert (mode, method) in methods
    assert "reference" not in {r["method"] for r in rows}
    for r in rows:
        if r["method"] == "sdpa":
            assert r["ms_x_sdpa"] == 1.0 and r["median_ms_x_sdpa"] == 1.0
        base = next(b for b in rows if b["method"] == "sdpa" and b["mode"] == r["mode"])
        for key in ("ms", "median_ms"):
            assert r[key] > 0 and abs(r[f"{key}_x_sdpa"] * base[key] - r[key]) < 1e-6 * r[key]
        assert r["median_ms"] >= r["ms"] and r["repeats"] == 1 and r["warmup"] == 5  # N = 64: 5 warm-up rounds
    assert "ratios to bias-free SDPA" in capsys.readouterr().out


def test_bench_prints_the_busy_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(benchmark.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    path = tmp_path / "bench.json"
    assert main(["bench", "--n", "16", "--causal", "causal", "--mode", "fwd", "--repeats", "1", "--no-memory",
                 "--heads", "1", "--head-dim", "8", "--budget-ms", "0", "--methods", "sdpa", "--json", str(path)]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING: machine busy")]
    assert len(warned) == 1 and "64.00 before" in warned[0]
    assert json.loads(path.read_text())["warnings"][0] == warned[0]


def test_memory_probe_sees_a_materialised_bias():
    # eager at N=1024, H=8 holds (8, 1024, 1024) float32 scores and probabilities: well over 32 MiB more than SDPA.
    spec = dict(n=1024, causal=False, mode="fwd", family="t5", batch=1, heads=8, head_dim=32, dtype="float32")
    sdpa, eager = memory({**spec, "method": "sdpa"}), memory({**spec, "method": "eager"})
    assert eager["growth_mib"] - sdpa["growth_mib"] > 32
    assert eager["peak_mib"] > sdpa["peak_mib"]
    # above the post-import baseline: the (1, 8, 1024, 32) float32 q, k, v are 3 MiB, not the ~200 MiB of torch
    assert 3 <= sdpa["peak_mib"] < sdpa["baseline_mib"] / 2


def test_bench_help_states_each_default_once(capsys):
    from relbias.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads THREADS torch.set_num_threads (default: PyTorch's choice) --max-scores" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--batch BATCH batch size B (default: 1)" in text
