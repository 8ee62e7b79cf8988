"""patch_t5(tensor_parallel=...) on a patched T5 whose attention is sharded by heads with parallelize_module: 2 gloo
processes ("tp" alone) and 4 ("tp" alone, and "cp" x "tp" on a 2 x 2 mesh); every rank's outputs and every
parameter's gradient equal the single-process model's, the bias table's gradient whole on every rank. Processes
started once per group size for the module; one torch thread each, loopback only, a 45 s timeout on every
collective, a join timeout, the process group destroyed in a ``finally``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from ._checks import assert_finished, assert_refused, assert_within_bounds, start_groups  # noqa: E402
from ._tp_cases import CASES, REFUSALS, applies  # noqa: E402

WORLD_SIZES = (2, 4)


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    return start_groups("_tp_cases", WORLD_SIZES, tmp_path_factory.mktemp("tensor_parallel"), timeout_s=240)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_finished(groups, world_size):
    assert_finished(groups[world_size])


@pytest.mark.parametrize(("world_size", "case"), [(p, c.name) for p in WORLD_SIZES for c in CASES if applies(c, p)])
def test_matches_one_process(groups, world_size, case):
    assert_within_bounds(groups[world_size], case)


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals(groups, world_size, name):
    assert_refused(groups[world_size], name, REFUSALS)
