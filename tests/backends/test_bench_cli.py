"""``relbias bench``: the table and the JSON carry every method with ratios to SDPA measured in the same run."""

from __future__ import annotations

import json

from relbias.cli.bench import _memory
from relbias.cli.main import main


def test_bench_writes_every_method_with_ratios(tmp_path, capsys):
    path = tmp_path / "bench.json"
    status = main(["bench", "--n", "64", "--causal", "causal", "--mode", "both", "--repeats", "1", "--no-memory",
                   "--heads", "2", "--head-dim", "16", "--json", str(path)])
    assert status == 0
    rows = json.loads(path.read_text())["rows"]
    methods = {(r["mode"], r["method"]) for r in rows if "ms" in r}
    for mode in ("fwd", "fwdbwd"):
        for method in ("sdpa", "sdpa_bias", "eager", "structured", "blockwise"):
            assert (mode, method) in methods
    for r in rows:
        if r["method"] == "sdpa":
            assert r["ms_x_sdpa"] == 1.0
        assert r["ms"] > 0 and abs(r["ms_x_sdpa"] * next(
            b["ms"] for b in rows if b["method"] == "sdpa" and b["mode"] == r["mode"]) - r["ms"]) < 1e-6 * r["ms"]
    assert "ratios to bias-free SDPA" in capsys.readouterr().out


def test_memory_probe_sees_a_materialised_bias():
    # eager at N=1024, H=8 holds (8, 1024, 1024) float32 scores and probabilities: well over 32 MiB more than SDPA.
    spec = dict(n=1024, causal=False, mode="fwd", family="t5", batch=1, heads=8, head_dim=32, dtype="float32")
    sdpa, eager = _memory({**spec, "method": "sdpa"}), _memory({**spec, "method": "eager"})
    assert eager["growth_mib"] - sdpa["growth_mib"] > 32
    assert eager["peak_mib"] > sdpa["peak_mib"]
