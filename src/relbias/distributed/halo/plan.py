"""Which keys each rank's window reaches beyond its own contiguous shard: the halo, and who sends it.

Under local attention (:mod:`relbias.window`) the query at position ``i`` sees keys ``i - left <= j <= i + right``
(``right`` is 0 under ``is_causal``). With the contiguous layout rank r holds positions ``[r·n, (r+1)·n)``, n = L/P,
so its queries reach the last ``left`` keys before its shard and the first ``right`` keys after it: a *halo* of at
most ``left + right`` keys, held by the ``ceil(left / n)`` ranks before it and the ``ceil(right / n)`` after it.
Rank r - d (d >= 1) sends its last ``min(n, left - (d-1)·n)`` keys (when positive), rank r + d its first
``min(n, right - (d-1)·n)``; every part is a run of consecutive positions, so positions follow from the layout and
need not travel.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...window import offset_band

__all__ = ["HaloPart", "HaloPlan", "halo_plan", "halo_reach"]


@dataclass(frozen=True)
class HaloPart:
    """One run of consecutive keys that moves between two ranks.

    Attributes:
        peer: the other rank (in the group): the owner for a part received, the receiver for a part sent.
        start: global position (tokens) of its first key.
        length: keys (tokens), >= 1.
        local: where the run lies in its owner's shard (a slice of the shard's rows).
    """

    peer: int
    start: int
    length: int
    local: slice


@dataclass(frozen=True)
class HaloPlan:
    """What one rank receives and sends for a window, each tuple in increasing global position.

    Attributes:
        left: the parts received from the ranks before this one (together, the keys just before its shard).
        right: the parts received from the ranks after it (the keys just after its shard).
        to_next: the parts of this shard sent to the ranks after it (its last keys; their ``left`` halos).
        to_prev: the parts of this shard sent to the ranks before it (its first keys; their ``right`` halos).
    """

    left: tuple[HaloPart, ...]
    right: tuple[HaloPart, ...]
    to_next: tuple[HaloPart, ...]
    to_prev: tuple[HaloPart, ...]

    @property
    def left_len(self) -> int:
        """Keys in the left halo."""
        return sum(p.length for p in self.left)

    @property
    def right_len(self) -> int:
        """Keys in the right halo."""
        return sum(p.length for p in self.right)


def halo_reach(window: tuple[int | None, int | None] | None, is_causal: bool) -> tuple[int, int] | None:
    """``(left, right)``: how far (tokens) a query's window reaches before and after it, or None when a side is
    unbounded (a halo would be the whole sequence on that side). ``right`` is 0 under ``is_causal``.

    Args:
        window: a validated window (:func:`relbias.window.check_window`) or None.
        is_causal: the causal rule, which bounds the right side at 0.
    """
    lo, hi = offset_band(window, is_causal)
    if lo is None or hi is None:
        return None
    return max(hi, 0), max(-lo, 0)


def _count(reach: int, distance: int, local_len: int) -> int:
    """Keys of the rank ``distance`` away that a reach of ``reach`` keys takes: the nearer ranks' ``local_len`` each
    come first."""
    return max(0, min(local_len, reach - (distance - 1) * local_len))


def halo_plan(rank: int, world_size: int, local_len: int, reach: tuple[int, int]) -> HaloPlan:
    """The halo of ``rank`` in a contiguous layout of ``world_size`` shards of ``local_len`` keys.

    Args:
        rank: r, 0 <= r < P; world_size: P >= 1; local_len: n >= 1 (tokens per rank).
        reach: ``(left, right)`` of :func:`halo_reach`, ints >= 0 (tokens).

    Returns:
        A :class:`HaloPlan`; every part has length >= 1, and a rank sends to a peer exactly the part that the peer's
        plan receives from it.
    """
    left, right = reach
    n = local_len

    def parts(side: int, received: bool) -> tuple[HaloPart, ...]:
        out = []
        for d in range(1, world_size):
            count = _count(left if side < 0 else right, d, n)
            if count == 0:
                break
            # received from the peer on ``side``; sent to the peer on the other side
            peer = rank + side * d if received else rank - side * d
            if not 0 <= peer < world_size:
                break
            owner = peer if received else rank
            # the left halo is the owner's last keys, the right halo its first
            local = slice(n - count, n) if side < 0 else slice(0, count)
            out.append(HaloPart(peer, owner * n + local.start, count, local))
        return tuple(sorted(out, key=lambda p: p.start))

    return HaloPlan(left=parts(-1, True), right=parts(1, True), to_next=parts(-1, False), to_prev=parts(1, False))
