"""Benchmark: local (sliding-window) attention against full attention, on long inputs.

One causal T5-biased attention call (B=1, H=8, D=64, float32 by default) at each length, with a causal window of
``--window`` keys (``window=(W - 1, 0)``), timed as the minimum of ``--repeats`` calls after a warm-up:

* ``full toeplitz``: relbias' toeplitz backend without a window (the baseline of the windowed rows: the same
  backend; skipped above ``--full-max`` tokens, where it takes minutes);
* ``window toeplitz`` and ``window blockwise``: relbias with the window (``backend=`` named);
* ``flex window``: ``torch.compile``d FlexAttention with a sliding-window block mask (``create_block_mask``, so tiles
  outside the band are skipped) and the same per-offset bias read in its ``score_mod`` (compiled once per length,
  not timed);

forward only, and forward + backward for the windowed relbias rows (``--backward``). Each row's peak memory is the
resident set's high-water mark above the level before the call (``/proc/self``, Linux; one process, so a row's
figure includes allocator caching of earlier rows at most). Ratios: time of ``full toeplitz`` at the same length
over the row's time, and time at each length over the first length's. Prints the load average before and after:
run it alone on an idle machine.

    python benchmarks/bench_window.py [--lengths 16384 32768] [--window 256] [--full-max 16384] [--backward]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import relbias
from _proc import reset_peak, status_kib


def _min_ms(fn, repeats: int) -> float:
    fn()  # warm-up (a first call builds kernels, compiles, fills caches)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _peak_mib(fn) -> float:
    """MiB the call adds to the resident set at its peak (VmHWM after a reset, above VmRSS before)."""
    before = status_kib("VmRSS")
    if not reset_peak():
        return float("nan")
    fn()
    return (status_kib("VmHWM") - before) / 1024


def _flex_window(bias: relbias.T5Bias, length: int, window: int, dtype: torch.dtype):
    """A compiled FlexAttention call with a causal sliding-window block mask and the T5 bias per offset."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    values = bias.native(length, length).values.detach().to(dtype)  # (H, 2L - 1): offset o at index o + L - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + values[h, q_idx - kv_idx + length - 1]

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    block_mask = create_block_mask(sliding, None, None, length, length, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="sequence lengths (tokens)")
    parser.add_argument("--window", type=int, default=256, help="keys each query sees, itself included (W)")
    parser.add_argument("--full-max", type=int, default=16384, help="longest length timed without a window")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (minimum reported)")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward of the windowed rows")
    parser.add_argument("--no-flex", action="store_true", help="skip the compiled FlexAttention rows")
    args = parser.parse_args()

    torch.manual_seed(0)
    heads, dim, window = args.heads, args.head_dim, (args.window - 1, 0)
    bias = relbias.T5Bias(heads, bidirectional=False)
    print(f"bench_window: torch {torch.__version__}, {torch.get_num_threads()} threads, B=1 H={heads} D={dim} "
          f"float32, causal T5 bias, window {args.window} keys; load average {os.getloadavg()[0]:.2f}")
    print(f"{'N':>6} {'method':>18} {'ms':>10} {'full/this':>10} {'x first N':>10} {'peak MiB':>9}")
    first_ms: dict[str, float] = {}
    for length in args.lengths:
        q, k, v = (torch.randn(1, heads, length, dim) for _ in range(3))
        rows = {}
        if length <= args.full_max:
            rows["full toeplitz"] = lambda: relbias.attention(q, k, v, bias=bias, is_causal=True, backend="toeplitz")
        for backend in ("toeplitz", "blockwise"):
            rows[f"window {backend}"] = (lambda b: lambda: relbias.attention(
                q, k, v, bias=bias, is_causal=True, window=window, backend=b))(backend)
        if not args.no_flex:
            flex = _flex_window(bias, length, args.window, q.dtype)
            rows["flex window"] = lambda: flex(q, k, v)
        if args.backward:
            for backend in ("toeplitz", "blockwise"):
                def step(b=backend):
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    relbias.attention(qg, kg, vg, bias=bias, is_causal=True, window=window, backend=b).sum().backward()
                rows[f"window {backend} f+b"] = step
        times = {}
        with torch.no_grad():
            for name, fn in rows.items():
                if name.endswith("f+b"):
                    continue
                times[name] = (_min_ms(fn, args.repeats), _peak_mib(fn))
        for name, fn in rows.items():
            if name.endswith("f+b"):
                times[name] = (_min_ms(fn, args.repeats), _peak_mib(fn))
        full = times.get("full toeplitz", (float("nan"),))[0]
        for name, (ms, peak) in times.items():
            first_ms.setdefault(name, ms)
            print(f"{length:>6} {name:>18} {ms:>10.1f} {full / ms:>10.2f} {ms / first_ms[name]:>10.2f} {peak:>9.0f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
