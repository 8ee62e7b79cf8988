"""context_parallel_attention on 2 and 4 gloo processes (CPU) against single-process relbias.attention.

Each group of processes is started once for the whole module (a module-scoped fixture): every rank runs every
case of ``_cases`` and writes its results to a file; the tests below read them. One torch thread per process,
``file://`` rendezvous in a fresh temporary folder, loopback only, a 45 s timeout on every collective, a join
timeout, and the process group destroyed in a ``finally``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._cases import B, D, H, HALO_CASES, ONE_RANK_REFUSALS, REFUSALS, SUBGROUP_CASES, comparison_cases
from ._spawn import run_ranks

WORKER = Path(__file__).with_name("_worker.py")
WORLD_SIZES = (2, 4)
JOIN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    base = tmp_path_factory.mktemp("context_parallel")
    return {p: run_ranks(WORKER, p, base / f"world{p}", timeout_s=JOIN_TIMEOUT_S) for p in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_finished(groups, world_size):
    for rank, res in enumerate(groups[world_size]):
        assert res.get("done") and res["returncode"] == 0, f"rank {rank} of {world_size}: {res['log']}"


@pytest.mark.parametrize("case", [c.name for c in comparison_cases()])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_single_process(groups, world_size, case):
    """Outputs and gradients (query, key, value, bias parameters) of every rank equal the unsharded
    single-process relbias.attention within 1e-5 (absolute, plus 1e-5 relative) in float32, 1e-10 in float64."""
    for rank, res in enumerate(groups[world_size]):
        got = res.get("comparisons", {}).get(case)
        assert got is not None, f"rank {rank} did not run {case}: {res['log']}"
        assert "exception" not in got, got.get("exception")
        bad = {k: v for k, v in got["errors"].items() if v > 0}
        assert not bad, f"rank {rank}/{world_size} {case}: beyond the bound by {bad}"


@pytest.mark.parametrize("case", [c.name for c in SUBGROUP_CASES])
def test_process_subgroups(groups, case):
    """4 processes as two groups of 2 (``group=``): each group's ranks match the single-process result."""
    test_matches_single_process({4: groups[4]}, 4, "subgroup:" + case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_skips_future_blocks_and_runs_far_blocks_bias_free(groups, world_size):
    """Causal rings skip blocks; T5 and clipped per-offset rings run far blocks bias-free (summed over ranks)."""
    def total(case):
        return [sum(res["comparisons"][case]["stats"][i] for res in groups[world_size]) for i in range(4)]

    blocks, skipped, free, biased = total("t5_causal-causal-contiguous-ring-pad")
    assert blocks == world_size**2 and skipped == world_size * (world_size - 1) // 2
    assert free + biased + skipped == blocks
    if world_size == 4:  # 16-token shards: offsets >= 17 from the second block down, beyond T5's far distance
        assert free > 0
        assert total("offset-bidir-zigzag-ring")[2] > 0
    assert total("none-bidir-contiguous-ring-pad")[2] == 0  # no bias: nothing is counted bias-free
    zigzag = total("t5_causal-causal-zigzag-ring")
    assert zigzag[0] == 4 * world_size**2
    # in 4 chunks of one piece each: P rotations' steps x 4 chunks x 2 query pieces per rank, and more of them far
    chunked = total("t5_causal-causal-zigzag-ring-pad-chunks4")
    assert chunked[0] == 8 * world_size**2
    assert chunked[1] + chunked[2] + chunked[3] == chunked[0]
    # a causal window of 10 keys: a query shard sees its own keys and at most the previous shard's
    windowed = total("t5_causal-causal-contiguous-ring-pad-window9_0")
    assert windowed[0] == world_size**2 and windowed[1] == world_size**2 - (2 * world_size - 1)


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals(groups, world_size, name):
    kind, words = REFUSALS[name]
    for rank, res in enumerate(groups[world_size]):
        raised = res.get("refusals", {}).get(name)
        assert raised is not None, f"rank {rank}: {name} was not refused"
        assert raised.startswith(kind + ":") and words in raised, raised
        if name in ONE_RANK_REFUSALS and rank != ONE_RANK_REFUSALS[name] % world_size:
            assert f"rank {ONE_RANK_REFUSALS[name] % world_size} of the group refused" in raised, raised


def _halo_bound(case, world_size: int) -> tuple[int, int]:
    """Bytes a rank may send per windowed call, forward and backward: ``(left + right)`` keys' key and value rows
    (B·H·(D + Dv) elements, in the input dtype forward and the compute dtype backward) plus their mask entries."""
    left, right = case.window
    keys = left + (0 if case.is_causal else right)
    itemsize = 8 if case.dtype == "float64" else 4
    forward = keys * B * H * 2 * D * itemsize + (keys * B if case.padding else 0)
    return forward, keys * B * H * 2 * D * itemsize


@pytest.mark.parametrize("case", [c.name for c in HALO_CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_halo_sends_only_the_window(groups, world_size, case):
    """A rank sends at most (left + right) keys' rows (with their mask entries) forward and their gradients backward,
    and exactly that much where both its neighbours' windows lie wholly inside its shard; what one rank sends, others
    receive."""
    spec = next(c for c in HALO_CASES if c.name == case)
    forward, backward = _halo_bound(spec, world_size)
    traffic = [res["comparisons"][case]["traffic"] for res in groups[world_size]]
    for rank, (sent, received, back_sent, back_received) in enumerate(traffic):
        assert 0 <= sent <= forward and 0 <= back_sent <= backward, (rank, traffic[rank], forward, backward)
    assert sum(t[0] for t in traffic) == sum(t[1] for t in traffic)
    assert sum(t[2] for t in traffic) == sum(t[3] for t in traffic)
    left, right = spec.window
    right = 0 if spec.is_causal else right
    if max(left, right) <= spec.seq_len // world_size and left + right > 0:  # a middle rank sends exactly the bound
        middle = traffic[1] if world_size > 2 else None
        if middle is not None:
            assert (middle[0], middle[2]) == (forward, backward), (middle, forward, backward)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_halo_traffic_does_not_grow_with_the_sequence(groups, world_size):
    """The same window at 64 and 128 tokens: every rank sends and receives the same bytes; the ring at 64 tokens
    sends more than the halo does."""
    short, long = HALO_CASES[0].name, HALO_CASES[1].name
    for res in groups[world_size]:
        assert res["comparisons"][short]["traffic"] == res["comparisons"][long]["traffic"]
        ring = res["comparisons"]["t5_causal-causal-contiguous-ring-pad-window9_0"]["traffic"]
        assert ring[0] > res["comparisons"][short]["traffic"][0]
    auto = [res["comparisons"]["t5_causal-causal-contiguous-auto-pad-window9_0"] for res in groups[world_size]]
    assert [a["traffic"] for a in auto] == [res["comparisons"][short]["traffic"] for res in groups[world_size]]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_output_may_be_changed_in_place(groups, world_size):
    """The returned output is not the tensor backward reads: changing it in place, then backward, works (ring, halo,
    ulysses; float32, where no cast copies it, and float64)."""
    for rank, res in enumerate(groups[world_size]):
        assert res.get("in_place") and not any(res["in_place"].values()), (rank, res.get("in_place"), res["log"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_halo_lends_the_neighbours_positions_and_returns_their_gradients(groups, world_size):
    """``gather_halo`` gives each rank its shard with the positions before and after it (windows shorter and longer
    than a shard), exactly, and backward sums every borrower's gradient into the owner's (float64, to rounding)."""
    for rank, res in enumerate(groups[world_size]):
        errors = res.get("gather_halo")
        assert errors and max(errors.values()) < 1e-12, (rank, errors, res["log"][-2000:])
