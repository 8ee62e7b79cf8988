"""Benchmark: packed variable-length sequences (``relbias.attention_varlen``) against the same sequences' calls run
one by one.

Eight sequences whose lengths are spread evenly from 256 to 1024 tokens (``--min-len``, ``--max-len``,
``--sequences``), H=8, D=64, float32, per family (T5, per-offset, ALiBi, KERPLE log), causal and bidirectional;
forward+backward (gradients of q, k, v and the bias parameters), two ways, timed round-robin in one process
(``relbias.benchmark.time_methods``: warm-up, then interleaved repeats, minimum):

* ``one by one``: ``relbias.attention`` on each sequence alone, (1, H, L_n, D), then its backward (the baseline);
* ``packed``: ``relbias.attention_varlen`` on the sequences concatenated along the length, (1, H, sum L_n, D), with
  their ``cu_seqlens``, then its backward.

Printed per row: both times, packed / one by one measured in the same run, the backend each runs
(``relbias.explain_backend`` on the longest sequence) and the 1-minute load average before and after.

Target: packed at most 1.15x one by one.

Usage::

    python benchmarks/bench_varlen.py
    python benchmarks/bench_varlen.py --families t5 --repeats 1      # smoke run
"""

from __future__ import annotations

import argparse
import os

import torch

import relbias
from relbias.benchmark import time_methods
from relbias.biases import make_bias


def _steps(family: str, causal: bool, lengths: list[int], heads: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    bias = make_bias(family, num_heads=heads, bidirectional=not causal, max_len=max(lengths))
    packed = [torch.randn(1, heads, total, dim, generator=gen).requires_grad_() for _ in range(3)]
    grad = torch.randn(1, heads, total, dim, generator=gen)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    # the same values, as separate leaves per sequence
    alone = [[t.detach()[:, :, a:b].clone().requires_grad_() for t in packed] for a, b in zip(bounds, bounds[1:])]
    leaves = [*packed, *(t for qkv in alone for t in qkv), *bias.parameters()]

    def one_by_one():
        for (q, k, v), a, b in zip(alone, bounds, bounds[1:]):
            relbias.attention(q, k, v, bias=bias, is_causal=causal).backward(grad[:, :, a:b])

    def packed_call():
        relbias.attention_varlen(*packed, bounds, bias=bias, is_causal=causal).backward(grad)

    def clear():
        for t in leaves:
            t.grad = None

    backend = relbias.explain_backend(*alone[-1], bias=bias, is_causal=causal)[0]
    return {"one by one": one_by_one, "packed": packed_call}, backend, clear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=256, help="shortest sequence, tokens")
    parser.add_argument("--max-len", type=int, default=1024, help="longest sequence, tokens")
    parser.add_argument("--families", nargs="+", default=["t5", "offset", "alibi", "kerple_log"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="fewest timed calls per method")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.sequences
    lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(n - 1, 1)) for i in range(n)]
    load_before = os.getloadavg()[0]
    print(f"forward+backward of {n} sequences of {lengths} tokens ({sum(lengths)} in all), H={args.heads}, "
          f"D={args.head_dim}, float32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'family':>11} {'mask':>6} {'one by one ms':>13} {'packed ms':>9} {'packed / one by one':>19}  backend")
    for family in args.families:
        for causal in (True, False):
            steps, backend, clear = _steps(family, causal, lengths, args.heads, args.head_dim)
            times = time_methods(steps, repeats=args.repeats, budget_ms=0.0, after=clear)
            base, packed = times["one by one"]["ms"], times["packed"]["ms"]
            print(f"{family:>11} {'causal' if causal else 'bidi':>6} {base:>13.0f} {packed:>9.0f} "
                  f"{packed / base:>18.2f}x  {backend}", flush=True)
    print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; ratios: minimum over "
          f"interleaved repeats; target: packed <= 1.15x one by one")


if __name__ == "__main__":
    main()
