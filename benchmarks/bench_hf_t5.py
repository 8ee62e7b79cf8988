"""Benchmark: a t5-small-shaped transformers encoder, unpatched vs patched with relbias (``patch_t5``).

Model: ``T5EncoderModel`` from a config with t5-small's shape (d_model 512, 8 heads, d_kv 64, 6 layers, d_ff 2048, ReLU
feed-forward, 32 buckets, max_distance 128, vocab 32128), random weights (seed 0), ``--dtype`` (default float32;
bfloat16 and float16: ``model.to(dtype)``, as half-precision serving does), eval mode, no gradients; input: random token
ids (batch, length), no padding. The unpatched model uses transformers' default attention ("sdpa", whose T5 path builds
a (1, 8, L, L) bias and passes it as SDPA's float mask).

Method. Every (length, variant) runs in a fresh Python process (``--child``), so that one configuration's memory
cannot hide in another's allocator pools. In that process, after the model and the input exist: garbage is
collected, the kernel's peak-RSS counter is reset (``echo 5 > /proc/self/clear_refs``), the resident size is read
(``VmRSS``), one forward runs, and the new peak (``VmHWM``) is read: *extra memory* = peak - resident before, MiB
(the first forward, so it includes one-time allocations such as thread pools, alike for both variants). Time: then
at least ``--repeats`` more forwards, and more until they took ``--budget-ms`` (at most 50), the median wall-clock
time and the median process CPU time (all threads; less sensitive than wall time to other processes' load), ms.
Each variant's process runs ``--rounds`` times, the variants alternating, and the round with the lower median is
reported (with its memory). Ratios (unpatched / patched) are printed per length.
Linux only (``/proc``). The machine may be shared: other processes' load inflates times (reported as the load
average before and after), not the memory figures.

Usage::

    python benchmarks/bench_hf_t5.py                         # lengths 128 512 2048 4096, batch 1
    python benchmarks/bench_hf_t5.py --batch 8 --threads 2
    python benchmarks/bench_hf_t5.py --lengths 4096 8192 --repeats 2 --backend auto
    python benchmarks/bench_hf_t5.py --batch 8 --lengths 4096 --variants unpatched patched bias-free
    python benchmarks/bench_hf_t5.py --lengths 512 2048 --variants unpatched patched bias-free --dtype bfloat16

The ``-compiled`` variants run the same model under ``torch.compile`` (inductor, static shapes): the first forward
compiles (its time, reported as "first", and its extra memory include compilation), the timed ones run the compiled
code; the patched model's attention is one custom op per layer in the graph (``relbias::toeplitz_forward``).

    python benchmarks/bench_hf_t5.py --variants unpatched patched unpatched-compiled patched-compiled --rounds 1

The ``bias-free`` variant is a bound, not a model: the patched model with every self-attention call running
bias-free SDPA (bias and mask dropped; wrong outputs), i.e. what the encoder would cost if the relative bias were
free. No exact implementation of the bias beats it, so ``unpatched / bias-free`` is the most any patch can gain.

Targets: the patched model no slower than unpatched at every length and batch size, >= 1.8x faster and >= 5x less
extra memory at 4096 tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from _proc import reset_peak, status_kib

MIB = 1024 * 1024


def run_child(args: argparse.Namespace) -> dict:
    """One configuration in this process: build, measure peak memory of one forward, then time ``repeats`` more."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    config = transformers.T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
        dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.T5EncoderModel._from_config(config, attn_implementation="sdpa").eval()
    model = model.to(getattr(torch, args.dtype))
    backend_used = None
    compiled = args.variant.endswith("-compiled")
    variant = args.variant.removesuffix("-compiled")
    if variant == "patched":
        from relbias.integrations.transformers import patch_t5

        patch_t5(model, backend=args.backend)
        backend_used = _backend_choice(model, args)
    elif variant == "bias-free":  # the bound: patched, then attention without the bias (this process only)
        import torch.nn.functional as F
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from relbias.integrations.transformers import ATTN_IMPLEMENTATION, patch_t5

        patch_t5(model)

        def bias_free(module, query, key, value, *args, **kwargs):
            out = F.scaled_dot_product_attention(query, key, value, scale=1.0)
            return out.transpose(1, 2).contiguous(), None

        ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] = bias_free
        backend_used = "bias-free SDPA (a bound)"
    if compiled:  # inductor, static shapes; the first forward below compiles (its time is "first")
        model = torch.compile(model, dynamic=False)
        backend_used = f"torch.compile; {backend_used}" if backend_used else "torch.compile"
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(1))

    with torch.inference_mode():
        gc.collect()
        reset_peak()
        before = status_kib("VmRSS")
        start = time.perf_counter()
        model(input_ids)
        first_ms = (time.perf_counter() - start) * 1e3
        peak = status_kib("VmHWM")
        times, cpu_times = [], []
        while len(times) < args.repeats or (sum(times) < args.budget_ms and len(times) < 50):
            start, cpu_start = time.perf_counter(), time.process_time()
            model(input_ids)
            times.append((time.perf_counter() - start) * 1e3)
            cpu_times.append((time.process_time() - cpu_start) * 1e3)
    return {
        "variant": args.variant, "length": args.length, "batch": args.batch, "backend": backend_used,
        "extra_mib": (peak - before) / 1024, "first_ms": first_ms, "median_ms": statistics.median(times),
        "cpu_ms": statistics.median(cpu_times),
        "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability(),
    }


def _backend_choice(model, args) -> str:
    """Which relbias backend the encoder's attention calls run (``relbias.explain_backend`` where it exists)."""
    import torch
    import relbias

    if args.backend not in (None, "auto"):
        return args.backend
    explain = getattr(relbias, "explain_backend", None)
    if explain is None:
        return "reference (relbias' default; no dispatcher)"
    q = torch.empty(args.batch, 8, args.length, 64, dtype=getattr(torch, args.dtype))
    from relbias.integrations import t5_biases_from_model

    bias = t5_biases_from_model(model).encoder[0]
    name, reason = explain(q, q, q, bias=bias, backend="auto")
    return f"auto -> {name}"


def _load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096],
                        help="input lengths in tokens (default 128 512 2048 4096; 8192 needs ~6 GiB unpatched)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="fewest timed forwards after the memory run (default 3)")
    parser.add_argument("--budget-ms", type=float, default=2000.0,
                        help="more timed forwards (up to 50) until they took this long (default 2000)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="each variant's process runs this many times, the variants alternating; the fastest "
                             "round's median is reported (default 2)")
    parser.add_argument("--backend", default=None,
                        help="relbias backend for the patched model (default: relbias.attention's default, 'auto')")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--variants", nargs="+", default=["unpatched", "patched"],
                        choices=["unpatched", "patched", "bias-free", "unpatched-compiled", "patched-compiled"])
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the model's dtype (default float32)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="patched", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return

    print(f"t5-small encoder (random weights), batch {args.batch}, {args.dtype}, CPU; load average before: "
          f"{_load_average()}")
    results = []
    for length in args.lengths:
        row = {}
        for variant in [v for _ in range(args.rounds) for v in args.variants]:
            command = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant,
                       "--length", str(length), "--batch", str(args.batch), "--repeats", str(args.repeats),
                       "--budget-ms", str(args.budget_ms), "--threads", str(args.threads),
                       "--dtype", args.dtype]
            if args.backend:
                command += ["--backend", args.backend]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  {variant} at {length} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(result)
            if variant not in row or result["median_ms"] < row[variant]["median_ms"]:
                row[variant] = result  # the faster round
        for variant in args.variants:
            if variant not in row:
                continue
            r = row[variant]
            print(f"  L={length:5d} {variant:18s} median {r['median_ms']:9.1f} ms wall, {r['cpu_ms']:9.1f} ms CPU "
                  f"(first {r['first_ms']:9.1f} ms)  extra {r['extra_mib']:8.1f} MiB  threads {r['threads']}  "
                  f"{r['isa']}  {r['backend'] or ''}")
        if "unpatched" in row and "bias-free" in row:
            bound = row["unpatched"]["median_ms"] / row["bias-free"]["median_ms"]
            print(f"  L={length:5d} bound     {bound:6.2f}x faster (wall) with attention as free as bias-free SDPA "
                  f"(unpatched / bias-free)")
        for suffix in ("", "-compiled"):
            if f"unpatched{suffix}" in row and f"patched{suffix}" in row:
                plain, patched = row[f"unpatched{suffix}"], row[f"patched{suffix}"]
                speed = plain["median_ms"] / patched["median_ms"]
                cpu = plain["cpu_ms"] / patched["cpu_ms"]
                memory = plain["extra_mib"] / max(patched["extra_mib"], 1e-9)
                label = "ratio" + (" compiled" if suffix else "")
                print(f"  L={length:5d} {label:14s} {speed:6.2f}x faster (wall), {cpu:6.2f}x (CPU time), "
                      f"{memory:6.2f}x less extra memory (unpatched{suffix} / patched{suffix})")
    print(f"load average after: {_load_average()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
