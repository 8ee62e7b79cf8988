"""T5's bucket function b(offset): which learnable scalar a (query, key) pair reads.

Source: Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", JMLR 21(140), §2.1; computed exactly as Mesh TensorFlow / Hugging Face transformers do,
including their float32 rounding (``relative_position = key_pos - query_pos = -offset`` there).
"""

from __future__ import annotations

import functools
import math

import torch

from ._int_args import check_int

__all__ = ["t5_bucket", "validate_t5_buckets", "t5_bucket_ranges"]

# Distances beyond this never open a new bucket in any valid configuration we check: the increments
# of the log region shrink with distance, so an empty bucket can only hide near its start.
_SCAN_LIMIT = 1 << 20


def _log_region_bucket(distance: torch.Tensor, max_exact: int, num_log: int, max_distance: int) -> torch.Tensor:
    """Bucket of distances >= max_exact within one direction, float32 as Hugging Face computes it."""
    # Clamp below at max_exact only to keep log() finite; such distances use the exact region anyway.
    d = torch.clamp(distance, min=max_exact)
    value = torch.log(d.float() / max_exact) / math.log(max_distance / max_exact) * num_log
    return torch.clamp(max_exact + value.to(torch.long), max=max_exact + num_log - 1)


def validate_t5_buckets(*, bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    """Check a T5 bucket configuration and raise with the reason when it is invalid.

    A configuration is valid when the function is defined and every bucket it declares can be reached
    (in bidirectional mode, bucket ``num_buckets // 2`` — distance 0 towards the future — is the one
    bucket that T5 itself never uses; it is allowed).

    Raises:
        TypeError: a setting is not an int / bool.
        ValueError: ``num_buckets`` < 2 (causal) or < 4 (bidirectional), odd ``num_buckets`` in
            bidirectional mode, ``max_distance`` not larger than the exact region
            (``num_buckets // 2`` causal, ``num_buckets // 4`` bidirectional), or ``max_distance`` so
            small that a log-region bucket would never be used.
    """
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be a bool, got {bidirectional!r}")
    check_int("num_buckets", num_buckets)
    check_int("max_distance", max_distance)
    _check_settings(bidirectional, num_buckets, max_distance)


@functools.lru_cache(maxsize=256)
def _check_settings(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    """The value checks of :func:`validate_t5_buckets`, once per setting (a lookup then costs O(1)); on the
    CPU whatever the default device (so that ``with torch.device("meta")`` works)."""
    if bidirectional:
        if num_buckets < 4:
            raise ValueError(
                f"bidirectional T5 buckets need num_buckets >= 4 (two directions, each with an exact "
                f"and a log region), got num_buckets={num_buckets}"
            )
        if num_buckets % 2:
            raise ValueError(
                f"bidirectional T5 buckets split num_buckets into two equal halves, got odd "
                f"num_buckets={num_buckets} (bucket {num_buckets - 1} would never be used)"
            )
    elif num_buckets < 2:
        raise ValueError(
            f"causal T5 buckets need num_buckets >= 2 (an exact and a log region), got num_buckets={num_buckets}"
        )
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_direction // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be larger than the exact region: distances below {max_exact} get one "
            f"bucket each, and the log region spans {max_exact}..max_distance; got max_distance={max_distance}"
        )
    num_log = per_direction - max_exact
    distances = torch.arange(max_exact, min(max_distance, _SCAN_LIMIT) + 1, device="cpu")
    used = torch.unique(_log_region_bucket(distances, max_exact, num_log, max_distance))
    expected = torch.arange(max_exact, per_direction, device="cpu")
    if used.numel() != expected.numel():
        missing = sorted(set(expected.tolist()) - set(used.tolist()))
        raise ValueError(
            f"max_distance={max_distance} is too small for the log region of {num_log} buckets starting "
            f"at distance {max_exact}: bucket(s) {missing} (per direction) would never be used; "
            f"raise max_distance or lower num_buckets"
        )


def t5_bucket(
    offset: torch.Tensor | int,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5 bucket ``b(offset)`` of each offset ``i - j`` (query position minus key position).

    Distances below ``max_exact`` (a quarter of ``num_buckets`` bidirectional, half causal) get one
    bucket each; larger distances share logarithmically wider buckets up to ``max_distance``; every
    distance from there on shares the last bucket of its direction. Bidirectional: past keys
    (offset > 0) use buckets ``0 .. num_buckets/2 - 1``, future keys (offset < 0) use
    ``num_buckets/2 + 1 .. num_buckets - 1``. Causal: future keys all map to bucket 0 (they are masked).

    Equal to Hugging Face transformers' ``T5Attention._relative_position_bucket(-offset, ...)``,
    including its float32 rounding at bucket boundaries (e.g. distances 16 and 64 for 32/128).

    Args:
        offset: int or integer tensor of any shape, in tokens.
        bidirectional: True for encoders (both directions), False for causal decoders.
        num_buckets: number of buckets (T5: 32; some T5-family models: 64 ...).
        max_distance: distance (tokens) at which the log region ends (T5: 128).

    Returns:
        int64 tensor, same shape and device as ``offset``, values in ``[0, num_buckets)``.

    Raises:
        TypeError: ``offset`` is a float, bool or complex tensor, or a setting has the wrong type.
        ValueError: an invalid configuration (see :func:`validate_t5_buckets`).

    Source: Raffel et al. 2020, JMLR, §2.1; Mesh TensorFlow ``_relative_position_bucket``.
    """
    if not torch.compiler.is_compiling():  # settings are plain numbers: checked once eagerly (T5Bias: at construction)
        validate_t5_buckets(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    if isinstance(offset, bool):
        raise TypeError("offset must be an int or an integer tensor, got a bool")
    if isinstance(offset, int):
        offset = torch.tensor(offset)
    if not isinstance(offset, torch.Tensor):
        raise TypeError(f"offset must be an int or an integer tensor, got {type(offset).__name__}")
    if offset.is_floating_point() or offset.is_complex() or offset.dtype == torch.bool:
        raise TypeError(f"offset must be an integer tensor (offsets are whole tokens), got dtype {offset.dtype}")
    offset = offset.long()
    if bidirectional:
        per_direction = num_buckets // 2
        base = (offset < 0).long() * per_direction  # future keys: upper half
        distance = offset.abs()
    else:
        per_direction = num_buckets
        base = torch.zeros_like(offset)
        distance = offset.clamp(min=0)  # future keys collapse to distance 0
    max_exact = per_direction // 2
    large = _log_region_bucket(distance, max_exact, per_direction - max_exact, max_distance)
    return base + torch.where(distance < max_exact, distance, large)


def t5_bucket_ranges(
    *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> list[tuple[int, int | None, int | None]]:
    """The offsets that fall in each T5 bucket, as closed ranges.

    Args:
        bidirectional, num_buckets, max_distance: as in :func:`t5_bucket`.

    Returns:
        One ``(bucket, lowest_offset, highest_offset)`` per bucket in bucket order, offsets in tokens
        (``i - j``). ``None`` stands for an unbounded end (the last bucket of each direction holds all
        larger distances); a bucket that no offset reaches (bidirectional bucket ``num_buckets // 2``)
        is ``(bucket, None, None)``. For causal buckets, bucket 0 also receives every future offset;
        its range lists only offset 0.

    Raises:
        ValueError, TypeError: an invalid configuration (see :func:`validate_t5_buckets`).

    Example:
        >>> t5_bucket_ranges(bidirectional=False, num_buckets=32, max_distance=128)[16:18]
        [(16, 16, 18), (17, 19, 20)]
    """
    if not torch.compiler.is_compiling():  # settings are plain numbers: checked once eagerly (T5Bias: at construction)
        validate_t5_buckets(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    limit = min(max_distance, _SCAN_LIMIT) + 1  # every bucket is first reached at a distance <= this
    distances = torch.arange(0, limit + 1)
    ranges: dict[int, tuple[int | None, int | None]] = {b: (None, None) for b in range(num_buckets)}
    directions = [1, -1] if bidirectional else [1]
    for sign in directions:
        offsets = sign * distances
        buckets = t5_bucket(offsets, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
        if sign < 0:
            offsets, buckets = offsets[1:], buckets[1:]  # offset 0 belongs to the past direction
        for b in torch.unique(buckets).tolist():
            hit = offsets[buckets == b]
            lo, hi = int(hit.min()), int(hit.max())
            if b == int(buckets[-1]):  # the saturating bucket of this direction is unbounded
                lo, hi = (lo, None) if sign > 0 else (None, hi)
            ranges[b] = (lo, hi)
    return [(b, *ranges[b]) for b in range(num_buckets)]
