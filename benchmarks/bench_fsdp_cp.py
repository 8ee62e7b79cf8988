"""Benchmark: training ByteLM with FSDP2 and context parallelism on 4 ranks, by how the ranks are split.

Configurations (dp x cp = 4 ranks): dp=4 (no context parallelism: every rank holds whole sequences), 2x2, and cp=4
(no data parallelism). Each data-parallel group trains on one sequence of ``--length`` tokens per step, the
long-context regime where a sequence is the unit of work, so a rank holds L / cp tokens: what context parallelism
buys is that a rank's share of a sequence falls with cp. FSDP2 shards parameters, gradients and AdamW's state
over all 4 ranks (the flattened dp x cp mesh) in every configuration; attention is relbias' ring over "cp"
(examples/fsdp_context_parallel.py's functions; a T5 bias, 2 layers, width 64, 4 heads).

Per configuration, the largest over ranks of:

* peak memory: the rank's peak resident set during the timed steps (``VmHWM`` after ``echo 5 >
  /proc/self/clear_refs``) above its resident set after imports (the native kernels' library included) and the
  process group, before the model and the data exist, MiB, with glibc's mmap threshold fixed at 64 KiB so that freed tensors leave the resident set;
* step time: wall-clock time of one AdamW step (forward, backward, clipping, update; median of ``--repeats``
  after one warm-up step), and the process CPU time summed over ranks.

Ratios against dp=4 measured in the same run are printed, with the 1-minute load average before and after.

Target: per-rank peak memory at 16384 tokens on 2x2 at most 0.6x that of dp=4.

Usage::

    python benchmarks/bench_fsdp_cp.py                      # 16384 tokens, dp x cp = 4x1, 2x2, 1x4
    python benchmarks/bench_fsdp_cp.py --length 2048 --repeats 1      # smoke run

Every configuration runs in 4 fresh processes of this script (``--child``) meeting through a ``file://``
rendezvous in a temporary folder: gloo on CPU, loopback only, one torch thread each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

from _proc import reset_peak, status_kib
from _ranks import run_child, spawn_ranks

MIB = 1024 * 1024
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_context_parallel.py"
CONFIGS = ((4, 1), (2, 2), (1, 4))


def _recipe():
    spec = importlib.util.spec_from_file_location("fsdp_context_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_rank(spec: dict) -> dict:
    """One rank of one (dp, cp) configuration, inside an initialised process group: its figures."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from relbias.experiments import ByteLM

    from relbias.backends.toeplitz import _native

    r = _recipe()
    dp, cp = spec["dp"], spec["cp"]
    mesh, fsdp_mesh = r.make_meshes(dp, cp)
    _native.load_native()  # the fused kernels' library, which every configuration loads, is part of the imports
    baseline = status_kib("VmRSS") * 1024  # after imports, the process group and the meshes; no model, no data
    config = r.bytelm_config("t5", spec["length"])
    if cp == 1:  # no context parallelism: plain attention on whole sequences
        torch.manual_seed(0)
        model = fully_shard(ByteLM(config), mesh=fsdp_mesh)
    else:
        model = r.build_bytelm(config, mesh, fsdp_mesh)
    batches = r.text_batches(spec["repeats"] + 1, dp, spec["length"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch) -> None:
        loss = r.loss_of(model, r.local_rows(batch, mesh), "bytelm")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dist.barrier()
    step(batches[0])  # warm-up: optimizer state, kernels built
    dist.barrier()
    reset_peak()
    walls, cpus = [], []
    for batch in batches[1:]:
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        step(batch)
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    peak = status_kib("VmHWM") * 1024 - baseline
    return {"rank": dist.get_rank(), "peak_mib": peak / MIB, "wall_ms": statistics.median(walls),
            "cpu_ms": statistics.median(cpus)}



def run_spawned(spec: dict) -> list[dict]:
    """One configuration in 4 fresh processes; their results, in rank order."""
    return spawn_ranks(__file__, spec["dp"] * spec["cp"], spec, threads=1, timeout_s=spec["timeout_s"] * 4,
                       what=f"dp={spec['dp']}, cp={spec['cp']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:], measure_rank, threads=1)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="tokens per sequence (divisible by 8)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for dp, cp in CONFIGS:
        spec = {"dp": dp, "cp": cp, "length": args.length, "repeats": args.repeats, "timeout_s": args.timeout_s}
        ranks = run_spawned(spec)
        rows.append({"config": f"{dp}x{cp}", "peak_mib": max(r["peak_mib"] for r in ranks),
                     "wall_ms": max(r["wall_ms"] for r in ranks), "cpu_sum_ms": sum(r["cpu_ms"] for r in ranks)})
        print(f"dp x cp = {dp}x{cp}: done", flush=True)
    base = rows[0]
    print(f"\nByteLM (T5 bias, 2 layers, width 64, 4 heads), one sequence of {args.length} tokens per data-parallel "
          f"group, 4 gloo ranks, FSDP2 over all of them")
    print(f"{'dp x cp':>8} {'tokens/rank':>11} {'peak MiB/rank':>14} {'x dp=4':>7} {'step ms':>9} {'x dp=4':>7} "
          f"{'CPU ms (sum)':>13} {'x dp=4':>7}")
    for (dp, cp), row in zip(CONFIGS, rows):
        print(f"{row['config']:>8} {args.length // cp:>11} {row['peak_mib']:>14.1f} {row['peak_mib'] / base['peak_mib']:>7.2f} "
              f"{row['wall_ms']:>9.0f} {row['wall_ms'] / base['wall_ms']:>7.2f} {row['cpu_sum_ms']:>13.0f} "
              f"{row['cpu_sum_ms'] / base['cpu_sum_ms']:>7.2f}")
    print(f"\nload average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"target: 2x2 peak <= 0.6x dp=4")


if __name__ == "__main__":
    main()
