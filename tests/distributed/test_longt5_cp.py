"""patch_longt5 with a process group on 2 and 4 gloo processes (CPU): every rank's outputs and every parameter's
gradient equal the unsharded single-process patched model's (local and transient-global encoders, padded rows, the
decoder); and its refusals. Processes started once per group size for the module; one torch thread each, loopback
only, a 45 s timeout on every collective, a join timeout, the process group destroyed in a ``finally``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from ._checks import assert_finished, assert_refused, assert_within_bounds, start_groups  # noqa: E402
from ._longt5_cases import CASES, REFUSALS  # noqa: E402

WORLD_SIZES = (2, 4)


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    return start_groups("_longt5_cases", WORLD_SIZES, tmp_path_factory.mktemp("longt5_cp"), timeout_s=240)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_finished(groups, world_size):
    assert_finished(groups[world_size])


@pytest.mark.parametrize("case", [c.name for c in CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_the_unsharded_model(groups, world_size, case):
    assert_within_bounds(groups[world_size], case)


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals(groups, world_size, name):
    assert_refused(groups[world_size], name, REFUSALS)
