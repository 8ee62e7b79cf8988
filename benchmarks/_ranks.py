"""Starting a benchmark's ranks: ``world`` fresh processes of the benchmark script itself (``--child RANK WORLD
INIT_FILE OUT SPEC_JSON``) meeting through a ``file://`` rendezvous in a temporary folder, each writing its figures
to a JSON file (not a benchmark; the distributed benchmarks share it)."""

from __future__ import annotations

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
