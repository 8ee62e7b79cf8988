"""Benchmark: the backend ``auto`` picks for a call, next to every backend's time for the same call, on this machine.

``relbias.attention(..., backend="auto")`` takes the first backend in priority order that can run a call and that
its rules do not pass over (:mod:`relbias.dispatch`); it does not time anything. This script checks on the machine
it runs on that the rules pick the fastest: for each call of a grid (bias family, causal or bidirectional, forward
or forward+backward, full-length and decoding-step shapes; for the first family also a bool key padding mask, an
additive float mask and dropout), it asks
``relbias.explain_backend`` which backend ``auto`` runs, times every registered backend that can run the call
(``explain_backend(..., backend=name)`` accepts it), interleaved round-robin in one process
(:func:`relbias.benchmark.time_methods`: warm-up, repeats, minimum), and prints each time, the fastest, and ``auto``'s
as a ratio to the fastest, marked ``!`` above ``--margin`` (default 1.10: repeats on a shared 2-core machine move by
about that much). FlexAttention compiles per shape (minutes on CPU) and ``auto`` takes it on CUDA only; it is timed
with ``--with-flex``.

B=1, H=8, D=64, float32 (the T5 family in T5's unscaled convention, the others scaled), ``--threads`` threads. Run
it under an instruction-set level's environment (benchmarks/bench_isa.py lists them) to check that level.

Usage::

    python benchmarks/bench_auto.py                      # the default grid, a few minutes on 2 cores
    python benchmarks/bench_auto.py --n 4096 --families t5 alibi --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import relbias
from relbias.backends import BACKENDS
from relbias.benchmark import time_methods
from relbias.biases import make_bias


def calls(args: argparse.Namespace):
    """(label, kwargs of relbias.attention, needs backward) for the grid."""
    gen = torch.Generator().manual_seed(0)
    b, h, d = 1, 8, 64
    for family in args.families:
        for causal in (True, False):
            bias = make_bias(family, num_heads=h, max_len=max(args.n + [args.decode_keys]), bidirectional=not causal)
            mask = "causal" if causal else "bidi"
            for n in args.n:
                q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
                for grad in (False, True):
                    yield f"{family} {mask} N={n} {'fwd+bwd' if grad else 'fwd'}", dict(
                        query=q, key=k, value=v, bias=bias, is_causal=causal), grad
                if family == args.families[0]:
                    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
                    keep[..., 3 * n // 4:] = False
                    yield f"{family} {mask} N={n} fwd+bwd padded", dict(
                        query=q, key=k, value=v, bias=bias, is_causal=causal, mask=keep), True
                    additive = torch.zeros(b, 1, 1, n).masked_fill(~keep, float("-inf"))
                    for grad in (False, True):
                        yield f"{family} {mask} N={n} {'fwd+bwd' if grad else 'fwd'} float mask", dict(
                            query=q, key=k, value=v, bias=bias, is_causal=causal, mask=additive), grad
                    yield f"{family} {mask} N={n} fwd+bwd dropout 0.1", dict(
                        query=q, key=k, value=v, bias=bias, is_causal=causal, dropout_p=0.1,
                        generator=torch.Generator().manual_seed(1)), True
            if causal:  # decoding steps: a few queries at the end of a long cache
                k, v = (torch.randn(b, h, args.decode_keys, d, generator=gen) for _ in range(2))
                for lq in (1, 16):
                    q = torch.randn(b, h, lq, d, generator=gen)
                    yield f"{family} causal Lq={lq} Lk={args.decode_keys} fwd", dict(
                        query=q, key=k, value=v, bias=bias, is_causal=True), False


def _options(kwargs: dict) -> dict:
    """A call's keyword arguments less query, key and value (what explain_backend takes beside them)."""
    return {key: value for key, value in kwargs.items() if key not in ("query", "key", "value")}


def _candidates(kwargs: dict, with_flex: bool) -> list[str]:
    """The registered backends that can run the call (explain_backend accepts them)."""
    explain = _options(kwargs)
    names = []
    for name in BACKENDS:
        if name == "flex" and not with_flex:
            continue
        try:
            relbias.explain_backend(kwargs["query"], kwargs["key"], kwargs["value"], backend=name, **explain)
        except ValueError:
            continue
        names.append(name)
    return names


def _step(name: str, kwargs: dict, grad: bool):
    """One call of backend ``name`` (forward, or forward and backward of the output's sum), gradients cleared."""
    bias = kwargs["bias"]

    def run():
        inputs = {key: (value.detach().requires_grad_() if key in ("query", "key", "value") and grad else value)
                  for key, value in kwargs.items()}
        if kwargs.get("generator") is not None:
            inputs["generator"] = torch.Generator().manual_seed(1)
        with torch.set_grad_enabled(grad):
            out = relbias.attention(backend=name, **inputs)
            if grad:
                out.sum().backward()
        if bias is not None:
            bias.zero_grad(set_to_none=True)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["t5", "offset", "alibi", "kerple_log", "fire"])
    parser.add_argument("--n", type=int, nargs="+", default=[512, 2048], help="tokens of the full-length calls")
    parser.add_argument("--decode-keys", type=int, default=2048, help="cached keys of the decoding steps")
    parser.add_argument("--repeats", type=int, default=3, help="fewest timed calls per backend")
    parser.add_argument("--budget-ms", type=float, default=300.0, help="more repeats until the slowest fills this")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--margin", type=float, default=1.10, help="auto / fastest above this is marked '!'")
    parser.add_argument("--with-flex", action="store_true", help="also time flex (compiles per shape)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen capability "
          f"{torch.backends.cpu.get_cpu_capability()}; load average before: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("minimum ms of interleaved repeats per backend that can run the call; auto's pick first")
    slower = 0
    for label, kwargs, grad in calls(args):
        with torch.set_grad_enabled(grad):  # an inference call is asked about as it runs: under no_grad
            picked, _ = relbias.explain_backend(kwargs["query"], kwargs["key"], kwargs["value"], **_options(kwargs))
            names = _candidates(kwargs, args.with_flex)
        times = time_methods({name: _step(name, kwargs, grad) for name in names}, repeats=args.repeats,
                             budget_ms=args.budget_ms)
        ms = {name: t["ms"] for name, t in times.items() if "ms" in t}
        fastest = min(ms, key=ms.get)
        ratio = ms[picked] / ms[fastest]
        mark = " !" if ratio > args.margin else ""
        slower += bool(mark)
        cells = "  ".join(f"{name} {ms[name]:.1f}" for name in [picked, *(n for n in ms if n != picked)])
        print(f"{label:40s} auto={picked:10s} x{ratio:4.2f} of fastest ({fastest}){mark}   {cells}", flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"{slower} call(s) where auto's pick was slower than the fastest by more than {args.margin:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
