"""``relbias explain``: which backend :func:`relbias.attention` runs for calls of the shapes ``relbias bench`` takes,
and why (:func:`relbias.explain_backend`, from the shell); runs no attention."""

from __future__ import annotations

import argparse

from .. import benchmark
from .bench import _HelpFormatter, _non_negative_float, _positive_int, add_shape_arguments

__all__ = ["explain", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``explain`` subcommand."""
    p = subparsers.add_parser(
        "explain",
        help="which backend relbias.attention runs for a call of this shape on this machine, and why",
        description="Print relbias.explain_backend's answer for each call of the given shapes, built as relbias "
        "bench builds them (random (B, H, N, D) inputs, the family's bias for N tokens, T5's unscaled scores; "
        "--mode fwd: an inference call under torch.no_grad(), fwdbwd: inputs and bias requiring grad): the backend "
        "that runs, the call in words and how that backend runs it, each backend 'auto' passed over and why, and "
        "notes on this machine (how half precision runs here). Runs no attention; the first answer may build the "
        "native kernels.",
        formatter_class=_HelpFormatter,
    )
    add_shape_arguments(p, lengths=[4096], causal="causal", mode="fwd")
    p.add_argument("--queries", type=_positive_int, default=None,
                   help="query rows Lq against the N keys, the last Lq positions (default: N; 1 for a decoding step)")
    p.add_argument("--dropout-p", type=_non_negative_float, default=0.0, help="attention dropout probability")
    p.add_argument("--backend", default="auto", help="'auto' or a backend's name: why it runs, or why it cannot")
    p.set_defaults(func=run)


def explain(args: argparse.Namespace, n: int, causal: bool, mode: str) -> tuple[str, str]:
    """``relbias.explain_backend``'s ``(name, reason)`` for one call of ``args``' shape with ``n`` keys."""
    import torch

    import relbias
    from relbias.biases import make_bias

    grad = mode == "fwdbwd"
    dtype = getattr(torch, args.dtype)
    queries = _queries(args, n)
    if queries > n:
        raise ValueError(f"--queries {queries} is more than the {n} keys of --n {n}")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, length, args.head_dim, generator=generator, dtype=dtype)
               .requires_grad_(grad) for length in (queries, n, n))
    bias = make_bias(args.family, num_heads=args.heads, max_len=n, bidirectional=not causal)
    if bias is not None:
        bias.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        return relbias.explain_backend(q, k, v, bias=bias, is_causal=causal, convention="t5", backend=args.backend,
                                       dropout_p=args.dropout_p)


def _queries(args: argparse.Namespace, n: int) -> int:
    """Lq: ``--queries``, else the ``n`` keys."""
    return n if args.queries is None else args.queries


def run(args: argparse.Namespace) -> int:
    """Print one answer per (length, masking, mode), in ``relbias bench``'s order (:func:`relbias.benchmark.calls`),
    a blank line between answers."""
    for index, (n, causal, mode) in enumerate(benchmark.calls(args)):
        _, reason = explain(args, n, causal, mode)
        print(("\n" if index else "") + f"# B={args.batch} H={args.heads} Lq={_queries(args, n)} Lk={n} "
              f"D={args.head_dim} {args.dtype}, bias {args.family}, {'causal' if causal else 'bidirectional'}, "
              f"{'forward+backward' if mode == 'fwdbwd' else 'forward (inference)'}")
        print(reason)
    return 0
