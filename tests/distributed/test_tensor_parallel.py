"""patch_t5(tensor_parallel=...) on a patched T5 whose attention is sharded by heads with parallelize_module: 2 gloo
processes ("tp" alone) and 4 ("tp" alone, and "cp" x "tp" on a 2 x 2 mesh); every rank's outputs and every
parameter's gradient equal the single-process model's, the bias table's gradient whole on every rank. Processes
started once per group size for the module; one torch thread each, loopback only, a 45 s timeout on every
collective, a join timeout, the process group destroyed in a ``finally``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from ._tp_cases import CASES, REFUSALS  # noqa: E402
from ._spawn import run_ranks  # noqa: E402

WORKER = Path(__file__).with_name("_tp_worker.py")
WORLD_SIZES = (2, 4)
JOIN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    base = tmp_path_factory.mktemp("tensor_parallel")
    return {p: run_ranks(WORKER, p, base / f"world{p}", timeout_s=JOIN_TIMEOUT_S, env={"HF_HUB_OFFLINE": "1"})
            for p in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_finished(groups, world_size):
    for rank, res in enumerate(groups[world_size]):
        assert res.get("done") and res["returncode"] == 0, f"rank {rank} of {world_size}: {res['log']}"


@pytest.mark.parametrize("case", [c for c in CASES], ids=[c.name for c in CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_one_process(groups, world_size, case):
    if case.context_parallel and world_size != 4:
        pytest.skip("a 2 x 2 (cp, tp) mesh needs 4 processes")
    for rank, res in enumerate(groups[world_size]):
        got = res.get("comparisons", {}).get(case.name)
        assert got is not None, f"rank {rank} did not run {case.name}: {res['log']}"
        assert "exception" not in got, got.get("exception")
        bad = {k: v for k, v in got["errors"].items() if v > 0}
        assert not bad, f"rank {rank}/{world_size} {case.name}: beyond the rounding tolerance by {bad}"


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals(groups, world_size, name):
    kind, words = REFUSALS[name]
    for rank, res in enumerate(groups[world_size]):
        raised = res.get("refusals", {}).get(name)
        assert raised is not None, f"rank {rank}: {name} was not refused"
        assert raised.startswith(kind + ":") and words in raised, raised
