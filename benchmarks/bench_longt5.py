"""Benchmark: a long-t5-tglobal-base-shaped transformers encoder, unpatched vs patched with relbias (``patch_longt5``).

Model: ``LongT5EncoderModel`` from a config with google/long-t5-tglobal-base's shape (d_model 768, 12 heads, d_kv 64,
12 layers, d_ff 2048 gated-GELU, 32 buckets, max_distance 128, local_radius 127, global_block_size 16, vocab 32128),
random weights (seed 0), float32, eval mode, no gradients; input: random token ids (batch, length), no padding, or
with ``--pad FRACTION`` a ragged batch: row ``k`` of ``B`` ends in ``round(FRACTION · length · (k + 1) / B)`` padding
tokens (batch 1: that fraction of the input), hidden by the attention mask.
``--kind local`` gives long-t5-local-base's encoder instead; ``--layers`` fewer layers (a smoke run).
The unpatched model runs transformers' blocked local attention (3 x 128 keys per query, the band as a mask) and, for
transient-global, its (B, N, N / 16, H) side bias.

Method (as ``bench_hf_t5.py``). Every (length, variant) runs in a fresh Python process (``--child``). In that
process, after the model and the input exist: garbage is collected, the kernel's peak-RSS counter is reset, the
resident size is read (``VmRSS``), one forward runs, and the new peak (``VmHWM``) is read: *extra memory* = peak -
resident before, MiB. Time: then at least ``--repeats`` more forwards, and more until they took ``--budget-ms`` (at
most 50): median wall-clock and process CPU time, ms. Each variant's process runs ``--rounds`` times, the variants
alternating; the round with the lower median is reported. Linux only (``/proc``). The machine may be shared: other
processes' load inflates times (the load average is printed before and after), not the memory figures.

Usage::

    python benchmarks/bench_longt5.py                                  # 512 2048 4096 8192 16384 tokens, batch 1
    python benchmarks/bench_longt5.py --lengths 512 --layers 2 --repeats 1 --rounds 1     # a smoke run
    python benchmarks/bench_longt5.py --lengths 16384 --variants unpatched patched --threads 16
    python benchmarks/bench_longt5.py --lengths 1500 8192 --pad 0.25 --variants unpatched patched

The ``free-attention`` variant is a bound, not a model: the patched model with every relbias call of the encoder
returning its values unchanged (no scores, no softmax; wrong outputs), so that what remains is the encoder without
attention's cost (projections, summaries, layer norms, feed-forward). No implementation of the attention beats it,
so ``unpatched / free-attention`` is the most any patch can gain, and ``(unpatched - patched) / (unpatched -
free-attention)`` the share of it the patch takes.

Targets: the patched encoder no slower than unpatched at every length from 512 to 16384 tokens, with less extra
memory from 4096, and at least half of what any patch could gain at 16384 (the share above >= 0.5).
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
    config = transformers.LongT5Config(
        vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=args.layers, num_heads=12,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        local_radius=127, global_block_size=16, encoder_attention_type=args.kind, dropout_rate=0.0,
        is_encoder_decoder=False, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LongT5EncoderModel._from_config(config).eval()
    backend_used = None
    if args.variant in ("patched", "free-attention"):
        from relbias.integrations import longt5, longt5_attention
        from relbias.integrations.transformers import patch

        patch(model, backend=args.backend)
        backend_used = f"relbias {args.backend or 'auto'}"
        if args.variant == "free-attention":  # the bound: every encoder attention call returns its values

            def free(query, key, value, *rest, return_lse=False, **kwargs):
                out = value[:, :, : query.shape[2]] if value.shape[2] >= query.shape[2] else query
                lse = torch.zeros(query.shape[:3], dtype=torch.float32)
                return (out, lse) if return_lse else out

            longt5.attention = longt5_attention.attention = free  # the local call and the summaries' call
            backend_used = "free attention (a bound)"
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    for row in range(args.batch):  # a ragged batch: row k's last round(pad * length * (k + 1) / batch) tokens
        attention_mask[row, args.length - round(args.pad * args.length * (row + 1) / args.batch):] = 0

    with torch.inference_mode():
        gc.collect()
        reset_peak()
        before = status_kib("VmRSS")
        start = time.perf_counter()
        model(input_ids, attention_mask=attention_mask)
        first_ms = (time.perf_counter() - start) * 1e3
        peak = status_kib("VmHWM")
        times, cpu_times = [], []
        while len(times) < args.repeats or (sum(times) < args.budget_ms and len(times) < 50):
            start, cpu_start = time.perf_counter(), time.process_time()
            model(input_ids, attention_mask=attention_mask)
            times.append((time.perf_counter() - start) * 1e3)
            cpu_times.append((time.process_time() - cpu_start) * 1e3)
    return {
        "variant": args.variant, "length": args.length, "batch": args.batch, "backend": backend_used,
        "kind": args.kind, "layers": args.layers, "pad": args.pad,
        "extra_mib": (peak - before) / 1024, "first_ms": first_ms, "median_ms": statistics.median(times),
        "cpu_ms": statistics.median(cpu_times),
        "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability(),
    }


def _load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--pad must be a fraction in [0, 1), got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192, 16384],
                        help="input lengths in tokens (default 512 2048 4096 8192 16384)")
    parser.add_argument("--kind", default="transient-global", choices=["transient-global", "local"],
                        help="encoder_attention_type (default transient-global: long-t5-tglobal-base)")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (default 12, the base model's)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--pad", type=_fraction, default=0.0,
                        help="padding: the last row's share of padding tokens, row k of B padding (k + 1) / B of it "
                             "(a ragged batch; default 0, no padding)")
    parser.add_argument("--repeats", type=int, default=3, help="fewest timed forwards after the memory run (default 3)")
    parser.add_argument("--budget-ms", type=float, default=2000.0,
                        help="more timed forwards (up to 50) until they took this long (default 2000)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="each variant's process runs this many times, the variants alternating; the fastest "
                             "round's median is reported (default 2)")
    parser.add_argument("--backend", default=None,
                        help="relbias backend for the patched model (default: relbias.attention's default, 'auto')")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--variants", nargs="+", default=["unpatched", "patched", "free-attention"],
                        choices=["unpatched", "patched", "free-attention"])
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="patched", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return

    print(f"long-t5-{'tglobal' if args.kind == 'transient-global' else 'local'}-base-shaped encoder ({args.layers} "
          f"layers, random weights), batch {args.batch}, padding {args.pad:g}, float32, CPU; load average before: "
          f"{_load_average()}")
    results = []
    for length in args.lengths:
        row = {}
        for variant in [v for _ in range(args.rounds) for v in args.variants]:
            command = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant,
                       "--length", str(length), "--batch", str(args.batch), "--repeats", str(args.repeats),
                       "--budget-ms", str(args.budget_ms), "--threads", str(args.threads), "--kind", args.kind,
                       "--layers", str(args.layers), "--pad", str(args.pad)]
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
            print(f"  L={length:5d} {variant:14s} median {r['median_ms']:9.1f} ms wall, {r['cpu_ms']:9.1f} ms CPU "
                  f"(first {r['first_ms']:9.1f} ms)  extra {r['extra_mib']:8.1f} MiB  threads {r['threads']}  "
                  f"{r['isa']}  {r['backend'] or ''}")
        if "unpatched" in row and "free-attention" in row:
            plain, free = row["unpatched"]["median_ms"], row["free-attention"]["median_ms"]
            print(f"  L={length:5d} bound     {plain / free:6.2f}x faster (wall) with attention at zero cost "
                  f"(unpatched / free-attention)")
            if "patched" in row and plain > free:
                share = (plain - row["patched"]["median_ms"]) / (plain - free)
                print(f"  L={length:5d} share     {share:6.2f} of what any patch could gain (wall)")
        if "unpatched" in row and "patched" in row:
            plain, patched = row["unpatched"], row["patched"]
            speed = plain["median_ms"] / patched["median_ms"]
            cpu = plain["cpu_ms"] / patched["cpu_ms"]
            memory = plain["extra_mib"] / max(patched["extra_mib"], 1e-9)
            print(f"  L={length:5d} ratio     {speed:6.2f}x faster (wall), {cpu:6.2f}x (CPU time), "
                  f"{memory:6.2f}x less extra memory (unpatched / patched)")
    print(f"load average after: {_load_average()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
