"""The attention benchmark engine behind ``relbias bench`` and benchmarks/bench_attention.py.

For each sequence length N, causal and bidirectional, forward and forward+backward, it measures in the
same run:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` without a bias (the baseline, 1.00x);
* ``sdpa_bias``: SDPA with the (H, N, N) bias materialised as ``attn_mask`` (causal mask folded in);
* ``eager``: the Hugging Face T5 path: ``q @ k^T + bias (+ mask)``, softmax in float32, ``@ v``;
* every registered backend (:data:`relbias.backends.BACKENDS`) through :func:`relbias.attention`
  (``reference``, ``flex``, ``decode`` and ``triton`` only when named: :data:`NOT_BY_DEFAULT`).

Time (ms): warm-up rounds first (:func:`warmup_rounds`), then timed rounds, the methods interleaved
round-robin so that load from other processes hits them alike; as many rounds as fill a time budget
for the slowest method, at least ``repeats`` (:func:`timed_rounds`); the minimum and the median are
reported. Peak memory (MiB): each (method, N, causal, mode) runs once in a fresh Python process, which
reports its peak resident set (``VmHWM``) above its resident set after the imports (inputs plus what
the call adds) and the call's own growth over the resident set with the inputs made. The 1-minute load
average is read before every configuration; :func:`busy_warning` says when the machine was busy, and
:func:`spread_warning` where a median strays far from its minimum.
Scores use T5's convention (unscaled, ``scale=1``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

from .backends import BACKENDS

__all__ = ["BASELINES", "NOT_BY_DEFAULT", "busy_warning", "calls", "default_methods", "load_sample", "measure",
           "method_names", "memory", "spread_warning", "time_methods", "timed_rounds", "warmup_rounds"]

#: bias-free SDPA (the 1.00x baseline), SDPA with the bias materialised, the Hugging Face eager path.
BASELINES = ("sdpa", "sdpa_bias", "eager")
#: backends measured only when named: reference materialises the scores (what sdpa_bias and eager show);
#: flex compiles per shape (minutes on CPU, and no backward there); triton runs on CUDA (on CPU only interpreted).
NOT_BY_DEFAULT = ("reference", "flex", "decode", "triton")  # decode: few queries only (a decoding step), not N x N
_MATERIALISING = ("sdpa_bias", "eager", "reference")


def method_names() -> list[str]:
    """Every method: the baselines, then the registered backends in priority order."""
    return [*BASELINES, *(name for name in BACKENDS if name not in BASELINES)]


def default_methods() -> list[str]:
    """:func:`method_names` less :data:`NOT_BY_DEFAULT`."""
    return [m for m in method_names() if m not in NOT_BY_DEFAULT]


def warmup_rounds(n: int) -> int:
    """Untimed rounds before timing at length ``n``: 1 from N = 1024, up to 5 for N <= 256."""
    return max(1, min(5, 1024 // n))


def timed_rounds(slowest_ms: float, repeats: int = 3, budget_ms: float = 500.0, max_repeats: int = 100) -> int:
    """Timed rounds so that the slowest method (``slowest_ms`` per call, from the warm-up) fills
    ``budget_ms``: ``ceil(budget_ms / slowest_ms)``, at least ``repeats`` (and 1), at most
    ``max(repeats, max_repeats)``."""
    top = max(repeats, max_repeats)
    wanted = math.ceil(budget_ms / slowest_ms - 1e-9) if slowest_ms > 0 else top  # 1e-9: clock rounding
    return max(1, min(top, max(repeats, wanted)))


def time_methods(steps: dict[str, Callable[[], None]], *, warmup: int = 1, repeats: int = 3, budget_ms: float = 500.0,
                 max_repeats: int = 100, clock: Callable[[], float] = time.perf_counter,
                 after: Callable[[], None] | None = None) -> dict[str, dict]:
    """Time each zero-argument ``steps[name]``, round-robin: ``warmup`` (at least 1) untimed rounds, then
    :func:`timed_rounds` rounds for the slowest method's fastest warm-up call (``clock`` in seconds;
    ``after`` runs untimed after every call).

    Returns name -> {"ms": minimum, "median_ms", "repeats", "warmup"} (ms), or {"error": one line} when a
    call raised RuntimeError, ValueError or MemoryError (that method is then left out of later rounds).
    """
    samples: dict[str, list[float]] = {m: [] for m in steps}
    errors: dict[str, str] = {}
    warm: dict[str, float] = {}  # fastest warm-up call of each method (s)

    def round_(keep: bool) -> None:
        for m, step in steps.items():
            if m in errors:
                continue
            try:
                start = clock()
                step()
                took = clock() - start
            except (RuntimeError, ValueError, MemoryError) as exc:
                errors[m] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
                continue
            finally:
                if after is not None:
                    after()
            if keep:
                samples[m].append(took)
            else:
                warm[m] = min(took, warm.get(m, took))

    for _ in range(max(1, warmup)):
        round_(keep=False)
    slowest = max((warm[m] for m in steps if m not in errors), default=0.0) * 1e3
    for _ in range(timed_rounds(slowest, repeats, budget_ms, max_repeats)):
        round_(keep=True)
    return {m: {"error": errors[m]} if m in errors else
            {"ms": min(s) * 1e3, "median_ms": statistics.median(s) * 1e3, "repeats": len(s), "warmup": max(1, warmup)}
            for m, s in samples.items()}


def load_sample() -> dict:
    """Now: {"load_1min": os.getloadavg()[0], "cpu_s": this process's CPU seconds (children included),
    "wall_s": time.perf_counter()}, for :func:`busy_warning`."""
    t = os.times()
    return {"load_1min": os.getloadavg()[0], "cpu_s": t.user + t.system + t.children_user + t.children_system,
            "wall_s": time.perf_counter()}


def busy_warning(before: dict, after: dict, cores: int | None = None, margin: float = 0.5) -> str | None:
    """A warning line when the machine was busy, else None.

    Busy: the 1-minute load average before the run, or after it less this process's own average CPU use
    during the run (CPU seconds / wall seconds), exceeds ``cores`` (default ``os.cpu_count()``) minus
    ``margin``. ``before``/``after`` are :func:`load_sample` results.
    """
    cores = cores or os.cpu_count() or 1
    wall = after["wall_s"] - before["wall_s"]
    own = (after["cpu_s"] - before["cpu_s"]) / wall if wall > 0 else 0.0
    others = max(before["load_1min"], after["load_1min"] - own)
    if others <= cores - margin:
        return None
    return (f"WARNING: machine busy: 1-minute load average {before['load_1min']:.2f} before, "
            f"{after['load_1min']:.2f} after the run (this process used {own:.2f} CPUs on average), "
            f"on {cores} cores (threshold {cores - margin:g}): times may be inflated; trust the minima "
            "over the medians, or rerun on an idle machine.")


def spread_warning(rows: list[dict], ratio: float = 2.0) -> str | None:
    """A warning line naming the configurations (N, mask, mode) where a method's median exceeds ``ratio``
    times its minimum (load from elsewhere during the timing), else None. ``rows``: :func:`measure`'s."""
    bad = dict.fromkeys(f"N={r['n']} {'causal' if r['causal'] else 'bidi'} {r['mode']}"
                        for r in rows if "median_ms" in r and r["median_ms"] > ratio * r["ms"])
    if not bad:
        return None
    return (f"WARNING: unstable times (median above {ratio:g}x the minimum) at {', '.join(bad)}: other load "
            "during the timing; compare the minima there, or rerun on an idle machine.")


def _inputs(spec: dict):
    import torch

    from .biases import make_bias

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


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM: this process image's peak resident set, not inherited)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(spec_json: str) -> None:
    """Fresh-process memory probe: print {"peak_mib", "growth_mib", "baseline_mib"} of one call as JSON."""
    import gc

    import torch.nn.functional  # noqa: F401  (the imports _step needs, before the baseline)

    import relbias  # noqa: F401

    spec = json.loads(spec_json)
    gc.collect()
    try:  # "5": reset VmHWM to the current resident set (Linux >= 4.0), so import-time peaks do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    baseline = _status_kib("VmRSS")
    q, k, v, bias = _inputs(spec)
    gc.collect()
    with_inputs = _status_kib("VmRSS")
    _step(spec["method"], spec, q, k, v, bias)
    peak = _status_kib("VmHWM")
    print(json.dumps({"peak_mib": max(0, peak - baseline) / 1024, "growth_mib": max(0, peak - with_inputs) / 1024,
                      "baseline_mib": baseline / 1024}))


def memory(spec: dict) -> dict:
    """Run ``spec`` (n, causal, mode, family, batch, heads, head_dim, dtype, method[, threads]) once in a
    fresh process: {"peak_mib": peak resident set above the post-import one, "growth_mib": what the call
    adds over the inputs, "baseline_mib": post-import resident set} (MiB), or {"error": last stderr line}."""
    code = "import sys; from relbias.benchmark import _child; _child(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _time(methods: list[str], spec: dict, args) -> dict:
    inputs = _inputs(spec)
    leaves = (*inputs[:3], *(inputs[3].parameters() if inputs[3] is not None else ()))

    def clear_grads() -> None:
        for t in leaves:
            t.grad = None

    steps = {m: (lambda m=m: _step(m, spec, *inputs)) for m in methods}
    return time_methods(steps, warmup=warmup_rounds(spec["n"]), repeats=args.repeats, budget_ms=args.budget_ms,
                        max_repeats=args.max_repeats, after=clear_grads)


def calls(args) -> list[tuple[int, bool, str]]:
    """``(n, causal, mode)`` of every call ``args`` asks for (``relbias bench``'s and ``relbias explain``'s
    ``--n``, ``--causal`` and ``--mode``), in the order they are measured: each length, causal before
    bidirectional, forward before forward+backward."""
    causals = {"both": [True, False], "causal": [True], "bidirectional": [False]}[args.causal]
    modes = {"both": ["fwd", "fwdbwd"], "fwd": ["fwd"], "fwdbwd": ["fwdbwd"]}[args.mode]
    return [(n, causal, mode) for n in args.n for causal in causals for mode in modes]


def measure(args, progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Every figure, as rows {n, causal, mode, method, ms (minimum), median_ms, repeats, warmup, load_1min,
    peak_mib, growth_mib, baseline_mib, <figure>_x_sdpa} (ms, MiB), or with "error" for a method that
    failed or was skipped.

    ``args`` has the attributes of ``relbias bench``'s options (n, causal, mode, methods, family, batch,
    heads, head_dim, dtype, repeats, budget_ms, max_repeats, threads, max_scores, no_memory);
    ``progress(row)`` is called as each row is made.
    """
    methods = list(dict.fromkeys(["sdpa", *args.methods]))
    rows = []
    for n, causal, mode in calls(args):
        spec = dict(n=n, causal=causal, mode=mode, family=args.family, batch=args.batch, heads=args.heads,
                    head_dim=args.head_dim, dtype=args.dtype, threads=args.threads)
        scores = args.batch * args.heads * n * n
        skipped = {m: {"error": "skipped: B*H*N*N above --max-scores"} for m in methods
                   if m in _MATERIALISING and scores > args.max_scores}
        if "flex" in methods and mode == "fwdbwd":  # no FlexAttention backward on CPU (torch 2.13)
            skipped["flex"] = {"error": "skipped: no FlexAttention backward on CPU"}
        run = [m for m in methods if m not in skipped]
        load = os.getloadavg()[0]
        timing = {**_time(run, spec, args), **skipped}
        for m in methods:
            row = {**spec, "method": m, "load_1min": load, **timing[m]}
            if not args.no_memory and m in run and m != "flex" and "error" not in row:
                row.update(memory({**spec, "method": m}))
            rows.append(row)
            if progress:
                progress(row)
    for row in rows:
        base = next(r for r in rows if r["method"] == "sdpa" and all(r[x] == row[x] for x in ("n", "causal", "mode")))
        for key in ("ms", "median_ms", "peak_mib", "growth_mib"):
            if key in row and key in base and base[key] > 0:
                row[f"{key}_x_sdpa"] = row[key] / base[key]
    return rows
