"""One rank of a model-level multi-process test: ``CASES=_longt5_cases python _model_worker.py RANK WORLD_SIZE
INIT_FILE OUT_JSON``.

Joins a gloo group (``file://`` rendezvous, loopback only, a timeout on every collective), runs every case of the
cases module ``CASES`` names (its ``CASES`` that ``applies(case, world_size)``, through ``run_case``) and every
refusal (``REFUSALS`` through ``run_refusal``), writes the results after each, and always destroys the group."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _spawn import rank_session  # noqa: E402  (this script's folder is sys.path[0])


def main() -> None:
    cases = importlib.import_module(os.environ["CASES"])
    with rank_session(sys.argv) as (rank, world_size, results, save):
        for case in cases.CASES:
            if not cases.applies(case, world_size):
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
