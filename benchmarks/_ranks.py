"""Starting a benchmark's ranks and running one: ``world`` fresh processes of the benchmark script itself (``--child RANK WORLD
INIT_FILE OUT SPEC_JSON``) meeting through a ``file://`` rendezvous in a temporary folder, each writing its figures
to a JSON file (not a benchmark; the distributed benchmarks share it)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile


def spawn_ranks(script: str, world: int, spec: dict, *, threads: int, timeout_s: float, what: str) -> list[dict]:
    """Run ``script --child ...`` in ``world`` processes (``threads`` OpenMP threads each, loopback gloo) and return
    their results in rank order; RuntimeError naming ``what`` (the configuration) when a rank fails.

    glibc's mmap threshold is fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``): every allocation of 64 KiB or more is
    then mapped on its own and unmapped when freed, so the peak resident set follows the live tensors (with the
    default, rising threshold, freed blocks stay in the heap: the same code measured 73 and 112 MiB on two runs).
    """
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo", MALLOC_MMAP_THRESHOLD_="65536")
        outs = [os.path.join(folder, f"rank{r}.json") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, script, "--child", str(r), str(world), os.path.join(folder, "rdzv"),
                                   outs[r], json.dumps(spec)], env=env) for r in range(world)]
        try:
            for p in procs:
                p.wait(timeout=timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed at {what} (return codes {[p.returncode for p in procs]})")
        results = []
        for out in outs:
            with open(out) as handle:
                results.append(json.load(handle))
        return results


def run_child(argv: list[str], measure, *, threads: int) -> None:
    """One spawned rank (``argv`` = RANK WORLD INIT_FILE OUT SPEC_JSON): ``threads`` torch threads, a gloo group through
    the ``file://`` rendezvous with ``spec["timeout_s"]`` on every collective, ``measure(spec)``'s figures written to
    OUT; the group is destroyed however it ends."""
    rank, world, init_file, out, spec = int(argv[0]), int(argv[1]), argv[2], argv[3], json.loads(argv[4])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    try:
        result = measure(spec)
        with open(out, "w") as handle:
            json.dump(result, handle)
    finally:
        dist.destroy_process_group()
