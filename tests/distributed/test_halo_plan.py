"""The halo plan: which keys beyond its shard each rank's windows reach, and who sends them (no processes needed)."""

from __future__ import annotations

import pytest

from relbias.distributed.halo.plan import halo_plan, halo_reach


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("local_len", [1, 4, 7])
@pytest.mark.parametrize("reach", [(0, 0), (1, 0), (3, 2), (0, 5), (9, 0), (13, 16), (40, 40)])
def test_halo_is_exactly_the_keys_the_windows_reach(world_size, local_len, reach):
    """Brute force over positions: a rank receives exactly the keys outside its shard that one of its queries sees,
    each part from the rank that holds it, and a rank's sends are the parts other ranks receive from it."""
    left, right = reach
    seq_len = world_size * local_len
    plans = [halo_plan(r, world_size, local_len, reach) for r in range(world_size)]
    for r, plan in enumerate(plans):
        own = range(r * local_len, (r + 1) * local_len)
        wanted = sorted({j for i in own for j in range(i - left, i + right + 1) if 0 <= j < seq_len and j not in own})
        for side, parts in (("left", plan.left), ("right", plan.right)):
            got = [p.start + t for p in parts for t in range(p.length)]
            want = [j for j in wanted if (j < own.start) == (side == "left")]
            assert got == want, (r, side, parts)
            for p in parts:
                assert p.length >= 1 and p.peer == p.start // local_len  # the owner sends it
                assert p.local == slice(p.start - p.peer * local_len, p.start - p.peer * local_len + p.length)
        for part in plan.left + plan.right:  # what r receives from a peer is what the peer's plan sends to r
            sent = [p for p in plans[part.peer].to_next + plans[part.peer].to_prev if p.peer == r]
            assert [(p.start, p.length, p.local) for p in sent] == [(part.start, part.length, part.local)]
        assert plan.left_len + plan.right_len == len(wanted)
        assert plan.left_len <= left and plan.right_len <= right
    sent = sum(p.length for plan in plans for p in plan.to_next + plan.to_prev)
    assert sent == sum(plan.left_len + plan.right_len for plan in plans)


def test_reach_of_windows():
    assert halo_reach((5, 3), is_causal=False) == (5, 3)
    assert halo_reach((5, 3), is_causal=True) == (5, 0)  # the causal rule bounds the right side at 0
    assert halo_reach((5, None), is_causal=True) == (5, 0)
    assert halo_reach((5, None), is_causal=False) is None  # unbounded on the right: every later key
    assert halo_reach((None, 3), is_causal=False) is None
    assert halo_reach(None, is_causal=True) is None
