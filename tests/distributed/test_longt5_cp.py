"""patch_longt5 with a process group on 2 and 4 gloo processes (CPU): every rank's outputs and every parameter's
gradient equal the unsharded single-process patched model's (local and transient-global encoders, padded rows, the
decoder); and its refusals. Processes started once per group size for the module; one torch thread each, loopback
only, a 45 s timeout on every collective, a join timeout, the process group destroyed in a ``finally``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from ._longt5_cases import CASES, REFUSALS  # noqa: E402
from ._spawn import run_ranks  # noqa: E402

WORKER = Path(__file__).with_name("_longt5_worker.py")
WORLD_SIZES = (2, 4)
JOIN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    base = tmp_path_factory.mktemp("longt5_cp")
    return {p: run_ranks(WORKER, p, base / f"world{p}", timeout_s=JOIN_TIMEOUT_S, env={"HF_HUB_OFFLINE": "1"})
            for p in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_finished(groups, world_size):
    for rank, res in enumerate(groups[world_size]):
        assert res.get("done") and res["returncode"] == 0, f"rank {rank} of {world_size}: {res['log']}"


@pytest.mark.parametrize("case", [c.name for c in CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_the_unsharded_model(groups, world_size, case):
    for rank, res in enumerate(groups[world_size]):
        got = res.get("comparisons", {}).get(case)
        assert got is not None, f"rank {rank} did not run {case}: {res['log']}"
        assert "exception" not in got, got.get("exception")
        bad = {k: v for k, v in got["errors"].items() if v > 0}
        assert not bad, f"rank {rank}/{world_size} {case}: beyond the rounding tolerance by {bad}"


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals(groups, world_size, name):
    kind, words = REFUSALS[name]
    for rank, res in enumerate(groups[world_size]):
        raised = res.get("refusals", {}).get(name)
        assert raised is not None, f"rank {rank}: {name} was not refused"
        assert raised.startswith(kind + ":") and words in raised, raised
