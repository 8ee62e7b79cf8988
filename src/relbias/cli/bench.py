"""``relbias bench``: time and peak memory of relative-bias attention against bias-free SDPA.

For each sequence length N, causal and bidirectional, forward and forward+backward, it measures in the
same run:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` without a bias (the baseline, 1.00x);
* ``sdpa_bias``: SDPA with the (H, N, N) bias materialised as ``attn_mask`` (causal mask folded in);
* ``eager``: the Hugging Face T5 path: ``q @ k^T + bias (+ mask)``, softmax in float32, ``@ v``;
* relbias backends (``structured``, ``blockwise``, optionally ``flex``) through :func:`relbias.attention`.

Time: the minimum over ``--repeats`` calls after one warm-up, methods interleaved round-robin so that
load from other processes hits them alike (ms). Peak memory: each (method, N, causal, mode) runs once in
a fresh Python process, which reports its peak resident set (``VmHWM`` of /proc/self/status) and its
growth over the resident set just before the call (MiB); both as ratios to SDPA's. Scores use T5's
convention (unscaled, ``scale=1``) with a T5 bias (32 buckets, max_distance 128) unless ``--family``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

__all__ = ["register", "run"]

METHODS = ("sdpa", "sdpa_bias", "eager", "structured", "blockwise", "flex")
DEFAULT_METHODS = ("sdpa", "sdpa_bias", "eager", "structured", "blockwise")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="time and peak memory of attention backends vs bias-free SDPA",
        description="Time (ms, minimum of interleaved repeats) and peak memory (MiB; 'peak MiB' is the fresh "
        "process's peak resident set, '+MiB' its growth during the call) of relative-bias attention backends, "
        "of SDPA with the bias materialised, and of a Hugging-Face-style eager path, each as a ratio to "
        "bias-free SDPA measured in the same run ('x sdpa').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a length, a count of heads or repeats); a clear error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relbias bench`` (shared with benchmarks/bench_attention.py)."""
    p.add_argument("--n", type=_positive_int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="sequence lengths (tokens)")
    p.add_argument("--causal", choices=["both", "causal", "bidirectional"], default="both", help="masking")
    p.add_argument("--mode", choices=["both", "fwd", "fwdbwd"], default="both", help="forward, forward+backward")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                   help="what to measure (flex compiles per shape: forward only on CPU)")
    p.add_argument("--family", default="t5", help="bias family (relbias.biases.FAMILIES), default t5")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size B")
    p.add_argument("--heads", type=_positive_int, default=8, help="num_heads H")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="head_dim D")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="input dtype")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed calls per method (minimum reported)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads (default: PyTorch's choice)")
    p.add_argument("--max-scores", type=_non_negative_float, default=2.2e9,
                   help="skip materialising methods (sdpa_bias, eager) above this many B*H*N*N scores")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory measurement")
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")


def _inputs(spec: dict):
    import torch

    from relbias.biases import make_bias

    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    grad = spec["mode"] == "fwdbwd"
    shape = (spec["batch"], spec["heads"], spec["n"], spec["head_dim"])
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=grad) for _ in range(3))
    bias = make_bias(spec["family"], num_heads=spec["heads"], max_len=spec["n"], bidirectional=not spec["causal"])
    if bias is not None:
        bias.requires_grad_(grad)
    return q, k, v, bias


def _step(method: str, spec: dict, q, k, v, bias) -> None:
    """One forward (no grad) or forward+backward of ``method``."""
    import torch
    import torch.nn.functional as F

    import relbias

    causal, n = spec["causal"], spec["n"]
    grad = spec["mode"] == "fwdbwd"
    with torch.set_grad_enabled(grad):
        if method == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
        elif method in ("sdpa_bias", "eager"):
            pe = bias(n, n).to(q.dtype) if bias is not None else torch.zeros(1, n, n, dtype=q.dtype)  # (H, N, N)
            if causal:
                pe = pe.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            if method == "sdpa_bias":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=pe, scale=1.0)
            else:  # Hugging Face T5Attention: scores += position_bias; softmax(float); matmul
                scores = torch.matmul(q, k.transpose(-2, -1)) + pe
                probs = torch.softmax(scores.float(), dim=-1).type_as(scores)
                out = torch.matmul(probs, v)
        else:
            out = relbias.attention(q, k, v, bias=bias, is_causal=causal, convention="t5", backend=method)
        if grad:
            out.sum().backward()


def _child(spec_json: str) -> None:
    """Fresh-process memory probe: print {"peak_mib", "growth_mib"} of one call as JSON."""
    import gc

    spec = json.loads(spec_json)
    q, k, v, bias = _inputs(spec)
    gc.collect()
    rss_before = _status_kib("VmRSS")
    _step(spec["method"], spec, q, k, v, bias)
    peak = _status_kib("VmHWM")
    print(json.dumps({"peak_mib": peak / 1024, "growth_mib": max(0, peak - rss_before) / 1024}))


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB. VmHWM is the peak resident set of this process image (unlike
    ru_maxrss, it is not inherited from the parent across fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory(spec: dict) -> dict:
    code = "import sys; from relbias.cli.bench import _child; _child(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _time(methods: list[str], spec: dict, repeats: int) -> dict:
    best = {m: float("inf") for m in methods}
    errors = {}
    inputs = _inputs(spec)
    for rep in range(repeats + 1):  # round 0 is the warm-up (and compilation for flex)
        for m in methods:
            if m in errors:
                continue
            try:
                start = time.perf_counter()
                _step(m, {**spec, "method": m}, *inputs)
                elapsed = time.perf_counter() - start
            except (RuntimeError, ValueError, MemoryError) as exc:
                errors[m] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
                continue
            if rep > 0:
                best[m] = min(best[m], elapsed)
            for t in (*inputs[:3], *(inputs[3].parameters() if inputs[3] is not None else ())):
                t.grad = None
    return {m: ({"error": errors[m]} if m in errors else {"ms": best[m] * 1e3}) for m in methods}


def measure(args: argparse.Namespace, progress=None) -> list[dict]:
    """Every figure: list of rows {n, causal, mode, method, ms, peak_mib, growth_mib, *_x_sdpa}."""
    causals = {"both": [True, False], "causal": [True], "bidirectional": [False]}[args.causal]
    modes = {"both": ["fwd", "fwdbwd"], "fwd": ["fwd"], "fwdbwd": ["fwdbwd"]}[args.mode]
    methods = list(dict.fromkeys(["sdpa", *args.methods]))
    rows = []
    for n in args.n:
        for causal in causals:
            for mode in modes:
                spec = dict(n=n, causal=causal, mode=mode, family=args.family, batch=args.batch, heads=args.heads,
                            head_dim=args.head_dim, dtype=args.dtype, threads=args.threads)
                scores = args.batch * args.heads * n * n
                run_methods = [m for m in methods if not (m in ("sdpa_bias", "eager") and scores > args.max_scores)]
                if "flex" in run_methods and mode == "fwdbwd":
                    run_methods.remove("flex")  # no FlexAttention backward on CPU (torch 2.13)
                timing = _time(run_methods, spec, args.repeats)
                for m in methods:
                    row = {**spec, "method": m, **timing.get(m, {"error": "skipped (--max-scores)"})}
                    if not args.no_memory and m in run_methods and m != "flex" and "error" not in row:
                        row.update(_memory({**spec, "method": m}))
                    rows.append(row)
                    if progress:
                        progress(row)
    for row in rows:
        base = next(r for r in rows if r["method"] == "sdpa" and all(r[x] == row[x] for x in ("n", "causal", "mode")))
        for key in ("ms", "peak_mib", "growth_mib"):
            if key in row and key in base and base[key] > 0:
                row[f"{key}_x_sdpa"] = row[key] / base[key]
    return rows


def _fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def run(args: argparse.Namespace) -> int:
    """Measure, print the table (and write JSON with ``--json``)."""
    import torch

    from ..biases import FAMILIES

    if args.family not in FAMILIES:
        raise ValueError(f"unknown bias family {args.family!r}; known: {sorted(FAMILIES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"relbias bench: torch {torch.__version__}, {torch.get_num_threads()} threads, B={args.batch} "
          f"H={args.heads} D={args.head_dim} {args.dtype}, bias {args.family}; load average {os.getloadavg()}")
    header = f"{'N':>5} {'mask':>6} {'mode':>6} {'method':>10} {'ms':>9} {'x sdpa':>7} {'peak MiB':>9} {'x sdpa':>7} {'+MiB':>8} {'x sdpa':>7}"

    def show(row):  # progress on stderr; the table with ratios follows on stdout
        where = f"{row['n']:>5} {'causal' if row['causal'] else 'bidi':>6} {row['mode']:>6} {row['method']:>10}"
        what = row["error"] if "error" in row and "ms" not in row else f"{_fmt(row, 'ms', '.1f')} ms"
        print(f"measured {where}  {what}", file=sys.stderr, flush=True)

    rows = measure(args, progress=show)
    print("ratios to bias-free SDPA (same run):")
    print(header)
    for row in rows:
        if "ms" not in row:
            continue
        print(
            f"{row['n']:>5} {'causal' if row['causal'] else 'bidi':>6} {row['mode']:>6} {row['method']:>10} "
            f"{_fmt(row, 'ms', '9.1f')} {_fmt(row, 'ms_x_sdpa', '7.2f')} {_fmt(row, 'peak_mib', '9.0f')} "
            f"{_fmt(row, 'peak_mib_x_sdpa', '7.2f')} {_fmt(row, 'growth_mib', '8.0f')} {_fmt(row, 'growth_mib_x_sdpa', '7.2f')}"
        )
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args) | {"func": None}, "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0
