"""Benchmark: context-parallel attention (relbias.distributed) for P = 1, 2, 4 ranks and long sequences.

What it measures, per (P, L): one self-attention call ``context_parallel_attention`` on (B, H, L/P, D) shards with
a T5 bias (32 buckets, max_distance 128), forward plus backward (gradients of q, k, v and the bias table):

* per-rank peak memory: inputs (this rank's q, k, v and output gradient) plus what the call adds (its output, the
  gradients, every temporary). CPU (gloo): the rank process's peak resident set during the timed steps
  (``VmHWM`` after ``echo 5 > /proc/self/clear_refs``) above its resident set after imports and the process group,
  before any input, MiB, with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed
  tensors leave the resident set; CUDA (nccl):
  ``torch.cuda.max_memory_allocated``, MiB. The largest over ranks is reported.
* time: wall-clock time of one forward+backward (median of ``--repeats`` after one warm-up), ms, the slowest
  rank; and the process CPU time of each rank summed over ranks (the "compute summed over ranks" figure; on a
  machine with fewer cores than ranks, wall time mostly measures the oversubscription).
* the fraction of ring blocks (forward, summed over ranks) that ran bias-free (far beyond T5's last bucket).

A row "attn" times single-device ``relbias.attention`` on the whole sequence in one process (``--no-single``
skips it): P = 1 of context-parallel attention is slower, since its backward recomputes the biased blocks.

Ratios against P = 1 measured in the same run are printed, and the 1-minute load average before and after.

Usage::

    python benchmarks/bench_context_parallel.py                          # P = 1 2 4, L = 8192 16384 32768
    python benchmarks/bench_context_parallel.py --world-sizes 1 2 --lengths 1024 --repeats 1   # smoke run
    # local attention (W = 256 keys, causal): the halo against the ring at each (P, L), in the same run
    python benchmarks/bench_context_parallel.py --window 256 --world-sizes 2 4 --lengths 65536
    # ... on GPUs, one strategy per launch
    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py --torchrun --backend nccl --window 256 \
        --strategy halo --lengths 1048576
    # several machines (one process per GPU, NCCL), one P per launch, printed by rank 0:
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 benchmarks/bench_context_parallel.py \\
        --torchrun --backend nccl --lengths 32768

In the default (spawn) mode every (P, L) runs in P fresh processes of this script (``--child``) that meet through
a ``file://`` rendezvous in a temporary folder (gloo on CPU; loopback only).

With ``--window W`` (causal T5 local attention over W keys, ``window=(W - 1, 0)``, contiguous layout) every
strategy of ``--strategies`` (default: halo, ring) runs at each (P, L) in the same run, and the table adds the bytes
each rank sent (``RingStats``), forward and backward, with ratios against the ring.

Targets: per-rank peak memory <= 1.2/P of the P = 1 figure plus a constant; with T5 at P = 4,
L = 16384, the compute time summed over ranks within 1.3x of the P = 1 time.
"""

from __future__ import annotations

import argparse
import datetime
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

    import relbias
    from relbias.distributed import RingStats, context_parallel_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = status_kib("VmRSS") * 1024  # after imports and the process group, before any input exists
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if spec["backend"] == "nccl" else torch.device("cpu")
    b, h, d, length = spec["batch"], spec["heads"], spec["head_dim"], spec["length"]
    gen = torch.Generator().manual_seed(0)
    bias = relbias.T5Bias(h, bidirectional=not spec["causal"]).to(device)
    local = length // world

    def make():  # this rank's shard only (random: the figures do not depend on the values)
        full_rows = torch.randn(b, h, local, d, generator=gen)
        return full_rows.to(device).requires_grad_(True)

    q, k, v = make(), make(), make()
    grad = torch.randn(b, h, local, d, generator=gen).to(device)
    stats = RingStats()

    def clear() -> None:  # the gradients of a step, freed before the next (else "before" would hold them)
        for t in (q, k, v, *bias.parameters()):
            t.grad = None

    window = None if spec.get("window") is None else (spec["window"] - 1, 0)  # W keys: itself and W - 1 before

    def step(count: bool) -> None:
        if spec.get("single"):  # the single-device call itself, for comparison
            out = relbias.attention(q, k, v, bias=bias, is_causal=spec["causal"], window=window)
        else:
            out = context_parallel_attention(
                q, k, v, bias=bias, is_causal=spec["causal"], layout=spec["layout"], strategy=spec["strategy"],
                kv_chunks=spec["kv_chunks"] if spec["strategy"] == "ring" else None, window=window,
                stats=stats if count else None,
            )
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()

    dist.barrier()
    step(True)  # warm-up; counts the blocks of one call
    clear()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = 0  # allocated memory counts tensors only: inputs included
    else:
        peak_ok = reset_peak()
        before = baseline
    walls, cpus = [], []
    for _ in range(spec["repeats"]):
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        step(False)
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
        clear()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = status_kib("VmHWM") * 1024 - before if peak_ok else float("nan")
    return {
        "rank": rank, "peak_mib": peak / MIB, "wall_ms": statistics.median(walls), "cpu_ms": statistics.median(cpus),
        "blocks": stats.blocks, "skipped": stats.skipped, "bias_free": stats.bias_free,
        "sent": stats.sent_bytes, "backward_sent": stats.backward_sent_bytes,
    }



def run_spawned(world: int, spec: dict) -> list[dict]:
    """Run one configuration in ``world`` fresh processes; their results, rank order."""
    return spawn_ranks(__file__, world, spec, threads=spec["threads"], timeout_s=spec["timeout_s"] * 4,
                       what=f"P={world}, L={spec['length']}")


def summarise(world: int, length: int, ranks: list[dict], single: bool = False) -> dict:
    ran = sum(r["blocks"] - r["skipped"] for r in ranks)
    return {
        "P": world, "label": "attn" if single else str(world), "L": length, "peak_mib": max(r["peak_mib"] for r in ranks),
        "wall_ms": max(r["wall_ms"] for r in ranks), "cpu_sum_ms": sum(r["cpu_ms"] for r in ranks),
        "bias_free": sum(r["bias_free"] for r in ranks) / ran if ran else None,  # None: no ring blocks (ulysses)
        "sent_mib": max(r["sent"] for r in ranks) / MIB, "backward_sent_mib": max(r["backward_sent"] for r in ranks) / MIB,
    }


def print_window_table(rows: list[dict]) -> None:
    """--window: each strategy's row, with ratios against the ring at the same (P, L)."""
    ring = {(r["P"], r["L"]): r for r in rows if r["label"] == "ring"}
    print(f"{'strategy':>8} {'P':>2} {'L':>8} {'sent MiB/rank fwd':>17} {'bwd':>8} {'peak MiB/rank':>14} {'x ring':>6} "
          f"{'fwd+bwd ms':>11} {'x ring':>6}")
    for r in rows:
        b = ring.get((r["P"], r["L"]))

        def ratio(key):
            return f"{r[key] / b[key]:6.2f}" if b and b[key] else f"{'-':>6}"

        print(f"{r['label']:>8} {r['P']:>2} {r['L']:>8} {r['sent_mib']:>17.2f} {r['backward_sent_mib']:>8.2f} "
              f"{r['peak_mib']:>14.1f} {ratio('peak_mib')} {r['wall_ms']:>11.1f} {ratio('wall_ms')}")


def print_table(rows: list[dict]) -> None:
    base = {r["L"]: r for r in rows if r["label"] == "1"}
    print(f"{'P':>4} {'L':>6} {'peak MiB/rank':>14} {'x P=1':>6} {'fwd+bwd ms':>11} {'x P=1':>6} "
          f"{'CPU ms (sum)':>13} {'x P=1':>6} {'bias-free':>9}")
    for r in rows:
        b = base.get(r["L"])

        def ratio(key):
            return f"{r[key] / b[key]:6.2f}" if b and b[key] else f"{'-':>6}"

        free = "-" if r["bias_free"] is None else f"{r['bias_free']:.1%}"
        print(f"{r['label']:>4} {r['L']:>6} {r['peak_mib']:>14.1f} {ratio('peak_mib')} {r['wall_ms']:>11.1f} "
              f"{ratio('wall_ms')} {r['cpu_sum_ms']:>13.1f} {ratio('cpu_sum_ms')} {free:>9}")


def run_windowed(args, spec: dict) -> None:
    """--window: every strategy at every (P, L), one configuration at a time, then the table."""
    load_before = os.getloadavg()
    print(f"context-parallel local attention, causal T5, window of {args.window} keys ({args.window - 1}, 0), "
          f"B={args.batch} H={args.heads} D={args.head_dim}, layout contiguous, forward+backward, {os.cpu_count()} "
          f"CPUs; load average {load_before[0]:.2f} (1 min)")
    rows = []
    for length in args.lengths:
        for world in args.world_sizes:
            for strategy in args.strategies:
                ranks = run_spawned(world, {**spec, "length": length, "strategy": strategy})
                rows.append({**summarise(world, length, ranks), "label": strategy})
    print_window_table(rows)
    print("sent: the most any rank sent (RingStats bytes), forward and backward; peak: the largest per-rank peak "
          "above its post-import resident set")
    print(f"load average {os.getloadavg()[0]:.2f} after (1 min)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:], measure_rank, threads=json.loads(sys.argv[6])["threads"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--bidirectional", action="store_true", help="bidirectional T5 encoder attention (default causal)")
    parser.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    parser.add_argument("--strategy", default="ring", choices=["ring", "ulysses", "halo", "auto"])
    parser.add_argument("--window", type=int, default=None,
                        help="local attention over W keys (window (W - 1, 0), causal, layout contiguous): each "
                             "(P, L) runs every strategy of --strategies in the same run")
    parser.add_argument("--strategies", nargs="+", default=["halo", "ring"], choices=["halo", "ring", "ulysses"],
                        help="with --window (default: halo ring)")
    parser.add_argument("--kv-chunks", type=int, default=None,
                        help="ring: chunks a shard's keys and values travel in (default: the library's automatic choice)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--timeout-s", type=int, default=1800, help="collective timeout per rank, seconds")
    parser.add_argument("--no-single", action="store_true", help="skip the single-device relbias.attention row")
    parser.add_argument("--torchrun", action="store_true", help="run under torchrun (env:// rendezvous), one P")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="with --torchrun")
    args = parser.parse_args()
    spec = {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "causal": not args.bidirectional,
            "layout": args.layout, "strategy": args.strategy, "repeats": args.repeats, "threads": args.threads,
            "kv_chunks": args.kv_chunks, "timeout_s": args.timeout_s, "backend": args.backend, "window": args.window}
    if args.window is not None:
        if args.bidirectional:
            parser.error("--window runs causal local attention (no --bidirectional)")
        spec["layout"] = "contiguous"
        if not args.torchrun:  # under torchrun: one strategy (--strategy) per launch, the table below
            run_windowed(args, spec)
            return
    load_before = os.getloadavg()
    print(f"context-parallel attention, T5 {'causal' if spec['causal'] else 'bidirectional'}, B={args.batch} "
          f"H={args.heads} D={args.head_dim}, layout {spec['layout']}, strategy {args.strategy}, "
          f"{'' if args.window is None else f'window ({args.window - 1}, 0), '}kv_chunks "
          f"{'auto' if args.kv_chunks is None else args.kv_chunks}, forward+backward, "
          f"{os.cpu_count()} CPUs; load average {load_before[0]:.2f} (1 min)")
    if args.torchrun:
        import torch
        import torch.distributed as dist

        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.set_num_threads(args.threads)
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s))
        try:
            rows = []
            for length in args.lengths:
                mine = measure_rank({**spec, "length": length})
                ranks = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, mine)
                rows.append(summarise(dist.get_world_size(), length, ranks))
            if dist.get_rank() == 0:
                print_table(rows)
        finally:
            dist.destroy_process_group()
    else:
        rows = []
        for length in args.lengths:
            for world in args.world_sizes:
                rows.append(summarise(world, length, run_spawned(world, {**spec, "length": length})))
            if not args.no_single:
                ranks = run_spawned(1, {**spec, "length": length, "single": True})
                rows.append(summarise(1, length, ranks, single=True))
        print_table(rows)
        if not args.no_single:
            print("attn: single-device relbias.attention (backend auto) on the whole sequence, one process; ratios "
                  "are against P = 1 of context-parallel attention")
    print(f"load average {os.getloadavg()[0]:.2f} after (1 min){'; ranks exceed the CPUs, so wall times include waiting' if max(args.world_sizes) * args.threads > (os.cpu_count() or 1) and not args.torchrun else ''}")


if __name__ == "__main__":
    main()
