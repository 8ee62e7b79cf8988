"""Benchmark: a training call's extras on the fused path, a key padding mask and attention dropout, per family.

For each offset-only family (T5, per-offset, ALiBi, KERPLE log), causal and bidirectional, one forward+backward of
``relbias.attention(..., backend="auto")`` at N tokens (B=2, H=8, D=64, float32; gradients of q, k, v and the bias
parameters), three ways, timed round-robin in one process (``relbias.benchmark.time_methods``: warm-up, then
interleaved repeats, minimum and median):

* ``plain``: no mask, no dropout (the baseline: toeplitz's fused kernels for an offset-only family, blockwise for FIRE);
* ``padded``: a bool key padding mask (B, 1, 1, N), the last quarter of the keys of every row padded (the form
  patched Hugging Face models pass);
* ``dropout``: attention dropout 0.1, no mask;
* ``sdpa``: bias-free ``scaled_dot_product_attention`` on the same q, k, v, no mask, no dropout (the speed to match).

Printed per row: the backend ``auto`` picks (``relbias.explain_backend``), the times and each as a ratio to
``plain`` measured in the same run, ``plain``, ``padded`` and ``dropout`` as ratios to ``sdpa``, and the 1-minute
load average before and after.

Targets: ``padded`` at most 1.10x and ``dropout`` at most 1.20x of ``plain``.

Usage::

    python benchmarks/bench_training_calls.py                         # N = 4096, every family
    python benchmarks/bench_training_calls.py --n 1024 --families t5 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import os

import torch

import relbias
from relbias.benchmark import time_methods
from relbias.biases import make_bias


def _calls(family: str, causal: bool, n: int, batch: int, heads: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    bias = make_bias(family, num_heads=heads, bidirectional=not causal, max_len=n)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, n, dim, generator=gen)
    keep = torch.ones(batch, 1, 1, n, dtype=torch.bool)
    keep[..., 3 * n // 4:] = False
    dropout = torch.Generator().manual_seed(1)
    variants = {"plain": {}, "padded": {"mask": keep}, "dropout": {"dropout_p": 0.1, "generator": dropout}}
    leaves = [q, k, v, *bias.parameters()]

    def step(kwargs):
        def run():
            out = relbias.attention(q, k, v, bias=bias, is_causal=causal, **kwargs)
            out.backward(grad)
        return run

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)

    def clear():
        for t in leaves:
            t.grad = None

    backends = {name: relbias.explain_backend(q, k, v, bias=bias, is_causal=causal, **kw)[0]
                for name, kw in variants.items()}
    return {"sdpa": sdpa, **{name: step(kw) for name, kw in variants.items()}}, backends, clear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="tokens")
    parser.add_argument("--families", nargs="+", default=["t5", "offset", "alibi", "kerple_log"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="fewest timed calls per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    parser.add_argument("--no-dropout", action="store_true", help="skip the dropout variant (its blockwise path is slow)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    print(f"forward+backward, N={args.n}, B={args.batch}, H={args.heads}, D={args.head_dim}, float32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'family':>11} {'mask':>6} {'plain ms':>9} {'plain/sdpa':>10} {'padded':>18} {'dropout 0.1':>19} "
          f"{'padded/sdpa':>11} {'dropout/sdpa':>12}")
    for family in args.families:
        for causal in (True, False):
            steps, backends, clear = _calls(family, causal, args.n, args.batch, args.heads, args.head_dim)
            if args.no_dropout:
                del steps["dropout"]
            times = time_methods(steps, repeats=args.repeats, budget_ms=0.0, after=clear)
            base = times["plain"]["ms"]

            def cell(name):
                t = times.get(name, {"error": "not run"})
                return f"{t['ms'] / base:5.2f}x {backends[name]:>11}" if "ms" in t else t["error"][:18]

            def to_sdpa(name):
                t = times.get(name, {})
                return f"{t['ms'] / times['sdpa']['ms']:.2f}x" if "ms" in t and "ms" in times["sdpa"] else "-"

            print(f"{family:>11} {'causal' if causal else 'bidi':>6} {base:>9.0f} {to_sdpa('plain'):>10} "
                  f"{cell('padded'):>18} {cell('dropout'):>19} {to_sdpa('padded'):>11} {to_sdpa('dropout'):>12}",
                  flush=True)
    print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; ratios: minimum over "
          f"interleaved repeats against plain (the same call without mask or dropout); targets: padded <= 1.10x, dropout <= 1.20x")


if __name__ == "__main__":
    main()
