"""``relbias build``: compile (or load) the toeplitz backend's native kernels ahead of the first call, say which
build runs and where it is cached, and with ``--check`` compare it with the reference backend.

The same command is ``python -m relbias build``. What is built and how is
:mod:`relbias.backends.toeplitz._build`.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["check", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``build`` subcommand."""
    p = subparsers.add_parser(
        "build",
        help="compile the native toeplitz kernels now (else the first call does)",
        description="Compile the toeplitz backend's fused C++ kernels for this machine, or load them from the cache "
        "or from an ahead-of-time build installed with the package, and print which build runs and where builds "
        "are cached. Environment: RELBIAS_NATIVE_MARCH (a -march value for the build, e.g. x86-64-v2; default "
        "native), RELBIAS_NATIVE_SANITIZE=1 (a build with AddressSanitizer and UBSan, in a cache folder of its own; "
        "Python must run with the ASan runtime preloaded, see docs/native-kernels.md), TORCH_EXTENSIONS_DIR or "
        "XDG_CACHE_HOME (the cache), CXX (the compiler).",
    )
    p.add_argument("--check", action="store_true",
                   help="also run a float64 forward and backward through the native kernels and compare them with "
                        "the reference backend (exit status 1 on a mismatch or when the native kernels do not run)")
    p.set_defaults(func=run)


def check() -> float:
    """The largest absolute difference between the toeplitz backend (native kernels) and the reference backend on a
    small float64 call (B=2, H=4, L=70, D=16, causal T5 bias): output and the gradients of query, key, value and
    the bias table, each divided by its reference's largest magnitude (a relative error)."""
    import torch

    import relbias

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 70, 16, dtype=torch.float64, generator=generator) for _ in range(3))
    grad = torch.randn(2, 4, 70, 16, dtype=torch.float64, generator=generator)
    results = []
    for backend in ("toeplitz", "reference"):
        torch.manual_seed(1)
        bias = relbias.T5Bias(4, num_buckets=16, max_distance=64, bidirectional=False, init_std=0.5).double()
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = relbias.attention(*inputs, bias=bias, is_causal=True, backend=backend)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in inputs] + [bias.weight.grad])
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() for a, b in zip(*results))


def run(args: argparse.Namespace) -> int:
    """Build or load the kernels, print the outcome; 1 where they do not run (or, with ``--check``, mismatch)."""
    from ..backends.toeplitz import _build as _native_build, _native as _toeplitz_native

    start = time.perf_counter()
    reason = _toeplitz_native.native_unavailable_reason()
    seconds = time.perf_counter() - start
    if reason is not None:
        print(f"the native toeplitz kernels do not run: {reason}", file=sys.stderr)
        return 1
    print(f"native toeplitz kernels: {_toeplitz_native.native_variant()}, ready in {seconds:.1f} s")
    print(f"builds on first use are cached under {_native_build.cache_root()}")
    if args.check:
        error = check()
        ok = error < 1e-10
        print(f"check against the reference backend (float64): largest relative difference {error:.2e} "
              f"({'ok' if ok else 'MISMATCH, expected < 1e-10'})")
        return 0 if ok else 1
    return 0
