"""What the model-level multi-process tests assert of the ranks' result files (not a test module): every rank
finished, a comparison within its bound on every rank, a refusal raised on every rank."""

from __future__ import annotations

from pathlib import Path

from ._spawn import run_ranks

WORKER = Path(__file__).with_name("_model_worker.py")


def start_groups(cases_module: str, world_sizes, folder: Path, timeout_s: float) -> dict[int, list[dict]]:
    """Each group size's ranks of ``_model_worker.py`` running the cases module ``cases_module``."""
    env = {"HF_HUB_OFFLINE": "1", "CASES": cases_module}
    return {p: run_ranks(WORKER, p, folder / f"world{p}", timeout_s=timeout_s, env=env) for p in world_sizes}


def assert_finished(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        assert res.get("done") and res["returncode"] == 0, f"rank {rank} of {len(ranks)}: {res['log']}"


def assert_within_bounds(ranks: list[dict], case: str) -> None:
    """Every rank ran ``case`` and each of its errors (how far beyond the bound) is 0."""
    for rank, res in enumerate(ranks):
        got = res.get("comparisons", {}).get(case)
        assert got is not None, f"rank {rank} did not run {case}: {res['log']}"
        assert "exception" not in got, got.get("exception")
        bad = {k: v for k, v in got["errors"].items() if v > 0}
        assert not bad, f"rank {rank}/{len(ranks)} {case}: beyond the rounding tolerance by {bad}"


def assert_refused(ranks: list[dict], name: str, refusals: dict) -> None:
    """Every rank raised the exception type and message words ``refusals[name]`` names."""
    kind, words = refusals[name]
    for rank, res in enumerate(ranks):
        raised = res.get("refusals", {}).get(name)
        assert raised is not None, f"rank {rank}: {name} was not refused"
        assert raised.startswith(kind + ":") and words in raised, raised
