"""Faults end in errors: a rank that raises in the middle of a context-parallel call (ring or halo), or that skips
its part of backward, makes every other rank raise a clear RuntimeError within the process group's timeout (5 s here), never
hang. 2 and 4 gloo processes per fault, each started once (``_fault_worker.py``), loopback only, a join timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._spawn import run_ranks

WORKER = Path(__file__).with_name("_fault_worker.py")
FAULTS = ("raise_mid_ring", "skip_backward", "raise_mid_halo", "skip_backward_halo")
WORLD_SIZES = (2, 4)
GROUP_TIMEOUT_S = 5.0  # _fault_worker.GROUP_TIMEOUT_S
JOIN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("faults")
    return {(fault, p): run_ranks(WORKER, p, base / f"{fault}{p}", timeout_s=JOIN_TIMEOUT_S, env={"FAULT": fault})
            for fault in FAULTS for p in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("fault", FAULTS)
def test_every_rank_raises_within_the_group_timeout(runs, fault, world_size):
    for rank, res in enumerate(runs[fault, world_size]):
        assert res["returncode"] == 0 and res.get("done"), f"rank {rank} did not finish:\n{res['log']}"
        raised = res["raised"]
        if rank == world_size - 1:  # the faulty rank: its own error, or nothing where it just skipped backward
            want = "RuntimeError: injected fault" if fault.startswith("raise") else None
            assert raised is None if want is None else raised.startswith(want), raised
            continue
        assert raised is not None and raised.startswith(f"RuntimeError: context-parallel attention, rank {rank} of "
                                                        f"{world_size}: "), raised
        assert "did not complete" in raised and "another rank of the group most likely raised" in raised, raised
        assert res["seconds"] < 4 * GROUP_TIMEOUT_S, res["seconds"]
