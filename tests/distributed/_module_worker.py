"""One rank of the module tests: ``python _module_worker.py RANK WORLD_SIZE INIT_FILE OUT_JSON``.

As ``_worker.py``: a gloo process group through a ``file://`` rendezvous (loopback, one torch thread, a timeout on
every collective); runs every case of ``_module_cases`` (MultiheadAttention, then T5, then the refusals, then one
comparison again to show that the refusals left nothing in flight), writes the results to OUT_JSON after each,
and always destroys the process group.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _module_cases as cases  # noqa: E402  (this script's folder is sys.path[0])


def main() -> None:
    rank, world_size, init_file, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    results: dict = {"comparisons": {}, "refusals": {}}

    def save() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, out_path)

    def compare(name, run, case, key=None) -> None:
        try:
            results["comparisons"][key or name] = run(case, rank, world_size)
        except Exception:  # noqa: BLE001 - reported to the test
            results["comparisons"][key or name] = {"exception": traceback.format_exc()}
        save()

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=45),
    )
    try:
        for case in cases.MHA_CASES:
            compare(case.name, cases.run_mha_case, case)
        for case in cases.T5_CASES:
            compare(case.name, cases.run_t5_case, case)
        for name in cases.REFUSALS:
            results["refusals"][name] = cases.run_refusal(name, rank, world_size)
            save()
        compare("again", cases.run_mha_case, cases.MHA_CASES[0], key="after-refusals:" + cases.MHA_CASES[0].name)
        dist.barrier()
        results["done"] = True
        save()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
