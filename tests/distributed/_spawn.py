"""Starting the gloo worker processes of a test module, and what each worker script shares (not a test module).

``run_ranks`` (test side) starts ``world_size`` copies of a worker script with a fresh ``file://`` rendezvous,
one torch thread each, loopback only, waits for them with a join timeout, kills stragglers, and returns every
rank's result file plus its exit code and log tail. ``rank_session`` (worker side) joins the process group with a
timeout on every collective, saves results atomically, and always destroys the group.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path


def run_ranks(worker: Path, world_size: int, folder: Path, *, timeout_s: float, env: dict | None = None) -> list[dict]:
    """Start ``world_size`` processes of ``worker`` (``RANK WORLD_SIZE INIT_FILE OUT_JSON``) and collect their results."""
    folder.mkdir(parents=True, exist_ok=True)
    init_file = folder / "rendezvous"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **(env or {}))
    outs = [folder / f"rank{r}.json" for r in range(world_size)]
    logs = [open(folder / f"rank{r}.log", "w") for r in range(world_size)]
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(r), str(world_size), str(init_file), str(outs[r])],
                         stdout=logs[r], stderr=subprocess.STDOUT, env=env)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for f in logs:
            f.close()
    results = []
    for r in range(world_size):
        data = json.loads(outs[r].read_text()) if outs[r].exists() else {}
        data["returncode"] = procs[r].returncode
        data["log"] = (folder / f"rank{r}.log").read_text()[-4000:]
        results.append(data)
    return results


@contextlib.contextmanager
def rank_session(argv: list[str], *, timeout_s: float = 45.0, barrier: bool = True):
    """Worker side: yields ``(rank, world_size, results, save)`` inside a gloo group (``timeout_s`` on every
    collective); ``save()`` writes ``results`` atomically to OUT_JSON; with ``barrier``, the ranks meet before
    ``done`` is saved; the group is destroyed however the body ends."""
    import torch
    import torch.distributed as dist

    rank, world_size, init_file, out_path = int(argv[1]), int(argv[2]), argv[3], argv[4]
    torch.set_num_threads(1)
    results: dict = {"comparisons": {}, "refusals": {}}

    def save() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, out_path)

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield rank, world_size, results, save
        if barrier:
            dist.barrier()
        results["done"] = True
        save()
    finally:
        dist.destroy_process_group()
