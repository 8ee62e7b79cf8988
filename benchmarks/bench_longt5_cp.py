"""Benchmark: a LongT5 encoder (t5-small-sized, transient-global) on context-parallel shards against one process.

What it measures, per (P, L): ``patch_longt5(encoder, process_group=...)`` with each of P ranks holding L/P tokens
(P = 1: the patched encoder on the whole sequence, no process group), forward alone (no gradients) and forward plus
backward (every parameter's gradient), on random token ids with no padding:

* time: wall-clock of one call (median of ``--repeats`` after one warm-up), ms, the slowest rank; and the process
  CPU time summed over ranks;
* per-rank peak memory: the rank's peak resident set during the timed forward+backward steps above its resident set
  after imports, the model and the process group, MiB, the largest over ranks (glibc's mmap threshold fixed at
  64 KiB, so freed tensors leave the resident set).

Ratios against P = 1 in the same run, and the 1-minute load average before and after, are printed.

The model: d_model 512, 8 heads of 64, d_ff 2048, 6 layers (t5-small's encoder), local_radius 127, global blocks of
16 tokens, 32 buckets up to distance 128, vocabulary 32128.

Usage::

    python benchmarks/bench_longt5_cp.py                                   # P = 1 2, L = 32768 65536
    python benchmarks/bench_longt5_cp.py --lengths 4096 --repeats 1        # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _proc import reset_peak, status_kib
from _ranks import run_child, spawn_ranks

MIB = 1024 * 1024


def measure_rank(spec: dict) -> dict:
    """One rank of one (P, L) configuration, inside an initialised process group: its figures."""
    import torch
    import torch.distributed as dist
    import transformers

    from relbias.distributed import shard
    from relbias.integrations.longt5 import patch_longt5

    rank, world = dist.get_rank(), dist.get_world_size()
    config = transformers.LongT5Config(
        d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6, local_radius=127, global_block_size=16,
        encoder_attention_type="transient-global", dropout_rate=0.0, vocab_size=32128,
    )
    torch.manual_seed(0)
    model = transformers.LongT5EncoderModel(config).eval()
    model = patch_longt5(model, process_group=dist.group.WORLD) if spec["sharded"] else patch_longt5(model)
    ids = torch.randint(2, 32128, (1, spec["length"]), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if spec["sharded"]:
        ids, mask = shard(ids, world, rank, dim=1), shard(mask, world, rank, dim=1)
    baseline = status_kib("VmRSS") * 1024

    def forward(grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            if grad:
                out.square().mean().backward()
        model.zero_grad(set_to_none=True)

    figures = {}
    for name, grad in (("fwd", False), ("fwd_bwd", True)):
        dist.barrier()
        forward(grad)  # warm-up
        peak_ok = reset_peak() if grad else False
        walls, cpus = [], []
        for _ in range(spec["repeats"]):
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            forward(grad)
            walls.append((time.perf_counter() - w0) * 1e3)
            cpus.append((time.process_time() - c0) * 1e3)
        figures[name + "_ms"] = statistics.median(walls)
        figures[name + "_cpu_ms"] = statistics.median(cpus)
        if grad:
            figures["peak_mib"] = (status_kib("VmHWM") * 1024 - baseline) / MIB if peak_ok else float("nan")
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:], measure_rank, threads=json.loads(sys.argv[6])["threads"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--timeout-s", type=int, default=1800, help="collective timeout per rank, seconds")
    args = parser.parse_args()
    print(f"LongT5 encoder (t5-small-sized, transient-global), B=1, {os.cpu_count()} CPUs, {args.threads} thread(s) "
          f"per rank; load average {os.getloadavg()[0]:.2f} (1 min)")
    rows = []
    for length in args.lengths:
        for world in args.world_sizes:
            spec = {"length": length, "sharded": world > 1, "repeats": args.repeats, "threads": args.threads,
                    "timeout_s": args.timeout_s}
            ranks = spawn_ranks(__file__, world, spec, threads=args.threads, timeout_s=args.timeout_s * 4,
                                what=f"P={world}, L={length}")
            rows.append({"P": world, "L": length, **{k: max(r[k] for r in ranks) for k in ranks[0]},
                         "cpu_sum": sum(r["fwd_bwd_cpu_ms"] for r in ranks)})
    base = {r["L"]: r for r in rows if r["P"] == 1}
    print(f"{'P':>2} {'L':>6} {'fwd ms':>9} {'x P=1':>6} {'fwd+bwd ms':>11} {'x P=1':>6} {'CPU ms (sum)':>13} "
          f"{'peak MiB/rank':>14} {'x P=1':>6}")
    for r in rows:
        b = base.get(r["L"])

        def ratio(key, row=r, one=b):
            return f"{row[key] / one[key]:6.2f}" if one else f"{'-':>6}"

        print(f"{r['P']:>2} {r['L']:>6} {r['fwd_ms']:>9.0f} {ratio('fwd_ms')} {r['fwd_bwd_ms']:>11.0f} "
              f"{ratio('fwd_bwd_ms')} {r['cpu_sum']:>13.0f} {r['peak_mib']:>14.0f} {ratio('peak_mib')}")
    print(f"load average {os.getloadavg()[0]:.2f} after (1 min)")


if __name__ == "__main__":
    main()
