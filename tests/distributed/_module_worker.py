"""One rank of the module tests: ``python _module_worker.py RANK WORLD_SIZE INIT_FILE OUT_JSON``.

As ``_worker.py``: a gloo process group through a ``file://`` rendezvous (loopback, one torch thread, a timeout on
every collective); runs every case of ``_module_cases`` (MultiheadAttention, then T5, then the refusals, then one
comparison again to show that the refusals left nothing in flight), writes the results to OUT_JSON after each,
and always destroys the process group.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _module_cases as cases  # noqa: E402  (this script's folder is sys.path[0])
from _spawn import rank_session  # noqa: E402


def main() -> None:
    with rank_session(sys.argv) as (rank, world_size, results, save):

        def compare(name, run, case, key=None) -> None:
            try:
                results["comparisons"][key or name] = run(case, rank, world_size)
            except Exception:  # noqa: BLE001 - reported to the test
                results["comparisons"][key or name] = {"exception": traceback.format_exc()}
            save()

        for case in cases.MHA_CASES:
            compare(case.name, cases.run_mha_case, case)
        for case in cases.T5_CASES:
            compare(case.name, cases.run_t5_case, case)
        for name in cases.REFUSALS:
            results["refusals"][name] = cases.run_refusal(name, rank, world_size)
            save()
        compare("again", cases.run_mha_case, cases.MHA_CASES[0], key="after-refusals:" + cases.MHA_CASES[0].name)


if __name__ == "__main__":
    main()
