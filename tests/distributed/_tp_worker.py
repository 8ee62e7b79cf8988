"""One rank of the tensor-parallel tests: ``python _tp_worker.py RANK WORLD_SIZE INIT_FILE OUT_JSON``.

Joins a gloo group (``file://`` rendezvous, loopback only, a timeout on every collective), runs every case and
refusal of ``_tp_cases``, writes the results after each, and always destroys the process group."""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _tp_cases as cases  # noqa: E402  (this script's folder is sys.path[0])
from _spawn import rank_session  # noqa: E402


def main() -> None:
    with rank_session(sys.argv) as (rank, world_size, results, save):
        for case in cases.CASES:
            if case.context_parallel and world_size != 4:
                continue
            try:
                results["comparisons"][case.name] = cases.run_case(case, rank, world_size)
            except Exception:  # noqa: BLE001 - reported to the test
                results["comparisons"][case.name] = {"exception": traceback.format_exc()}
            save()
        for name in cases.REFUSALS:
            results["refusals"][name] = cases.run_refusal(name, rank, world_size)
            save()


if __name__ == "__main__":
    main()
