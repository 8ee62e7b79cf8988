"""Local (sliding-window) attention: the keys a query may see, as a band of offsets.

``window=(left, right)`` lets the query at position ``i`` see the keys ``j`` with ``i - left <= j <= i + right``,
that is the offsets ``-right <= i - j <= left`` (docs/conventions.md); ``None`` leaves that side unbounded. This is
FlashAttention's ``window_size=(left, right)`` (Dao 2023) in relbias' offset terms, with ``None`` where
FlashAttention writes -1, and the sliding window of Longformer (Beltagy et al. 2020, §3.1) and Mistral (Jiang et al.
2023) as ``(W - 1, 0)`` with ``is_causal=True``. Positions are the absolute ones relbias aligns (``query_start``,
``key_start``), so a window means the same in a KV-cache step, a chunk of a prefill or a context-parallel shard.

The window composes with the causal rule (``is_causal`` bounds the right side at 0), masks, dropout and every bias:
it only removes keys. A query whose window holds no key gets output 0 and lse -inf, as with a mask.
"""

from __future__ import annotations

from numbers import Integral

__all__ = ["check_window", "kernel_sides", "key_range", "offset_band"]



def check_window(window: object) -> tuple[int | None, int | None] | None:
    """Validate ``window`` and return it as ``(left, right)`` of Python ints or None, or None when it bounds nothing.

    Args:
        window: None (no window), or a pair ``(left, right)`` (tuple or list), each an int >= 0 (tokens) or None
            (unbounded on that side).

    Raises:
        TypeError: not a pair, or a side that is neither an int nor None (a bool or a float included).
        ValueError: a negative side (FlashAttention's -1 for "unbounded" is None here).
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            f"window must be None or a pair (left, right) of keys a query sees before and after itself, e.g. "
            f"(255, 0) with is_causal=True for 256 keys; got {window!r}"
        )
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, Integral):
            raise TypeError(f"window {name} must be an int >= 0 (tokens) or None (unbounded), got {side!r}")
        if side < 0:
            raise ValueError(
                f"window {name} must be >= 0 (tokens), got {side}; for no bound on that side pass None "
                f"(FlashAttention writes -1)"
            )
        sides.append(int(side))
    left, right = sides
    return None if left is None and right is None else (left, right)


def offset_band(window: tuple[int | None, int | None] | None, is_causal: bool) -> tuple[int | None, int | None]:
    """``(lo, hi)``: the offsets ``lo <= i - j <= hi`` a query may see under ``window`` (validated) and the causal
    rule; None is unbounded. ``(None, None)`` without a window or causal rule."""
    left, right = window if window is not None else (None, None)
    lo = None if right is None else -right
    if is_causal:
        lo = 0 if lo is None else max(lo, 0)
    return lo, left


def key_range(band: tuple[int | None, int | None], first: int, last: int, key_len: int) -> tuple[int, int]:
    """``[begin, end)``: the keys (indices into a block of ``key_len`` keys) that some query with offset-to-key-0
    ``first ... last`` may see (``first = query_start - key_start`` for the first query of a run, ``last`` for its
    last), under ``band = (lo, hi)`` (:func:`offset_band`). Key ``s`` is visible to that query ``t`` when
    ``lo <= t - s <= hi``. ``begin >= end`` when none is."""
    lo, hi = band
    begin = 0 if hi is None else max(0, first - hi)
    end = key_len if lo is None else min(key_len, last - lo + 1)
    return begin, end


def kernel_sides(window: tuple[int | None, int | None] | None, min_offset: int, max_offset: int) -> tuple[int, int]:
    """``(left, right)`` as native kernels take them: -1 for a side that is None or bounds nothing in a block whose
    offsets run from ``min_offset`` to ``max_offset`` (so no kernel adds a window's large side to a position)."""
    left, right = window if window is not None else (None, None)
    return (-1 if left is None or left >= max_offset else left,
            -1 if right is None or right >= -min_offset else right)
