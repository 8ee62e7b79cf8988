"""``relbias buckets``: the offsets that fall in each T5 bucket."""

from __future__ import annotations

import argparse
import json

from ..buckets import t5_bucket_ranges

__all__ = ["format_range", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``buckets`` subcommand."""
    p = subparsers.add_parser(
        "buckets",
        help="print the offset range of each T5 bucket",
        description="Print which offsets i - j (query minus key position, tokens) share each T5 bucket "
        "(Raffel et al. 2020, section 2.1). In bidirectional mode bucket num_buckets/2 is never used: it "
        "would hold distance 0 towards the future, which is offset 0, already bucket 0.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-buckets", type=int, default=32, help="number of buckets")
    p.add_argument("--max-distance", type=int, default=128, help="distance (tokens) where the log region ends")
    p.add_argument("--causal", action="store_true", help="causal (decoder) buckets; default bidirectional")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def format_range(lo: int | None, hi: int | None) -> str:
    """``lo .. hi`` of a bucket's offsets, with -inf / +inf for open ends (or why the bucket is empty)."""
    if lo is None and hi is None:
        return "(unused: distance 0 towards the future is offset 0, bucket 0)"
    return f"{'-inf' if lo is None else lo} .. {'+inf' if hi is None else hi}"


def run(args: argparse.Namespace) -> int:
    """Print the bucket map; offsets are ``i - j`` (query minus key position, tokens)."""
    ranges = t5_bucket_ranges(
        bidirectional=not args.causal, num_buckets=args.num_buckets, max_distance=args.max_distance
    )
    if args.json:
        print(json.dumps([{"bucket": b, "lowest_offset": lo, "highest_offset": hi} for b, lo, hi in ranges]))
        return 0
    print("bucket  offsets i - j (query minus key position)")
    for b, lo, hi in ranges:
        print(f"{b:6d}  {format_range(lo, hi)}")
    return 0
