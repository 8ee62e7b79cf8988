"""One rank of the multi-process tests: ``python _worker.py RANK WORLD_SIZE INIT_FILE OUT_JSON``.

Joins a gloo process group through a ``file://`` rendezvous (loopback only, a timeout on every collective), runs
every case of ``_cases`` (comparisons, then refusals, then one comparison again to show that refusals left no
message in flight; with 4 processes, some cases again in two process groups of 2), writes the results to OUT_JSON after each case, and always destroys the process group.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch.distributed as dist  # noqa: E402

import _cases  # noqa: E402  (this script's folder is sys.path[0])
from _spawn import rank_session  # noqa: E402


def main() -> None:
    with rank_session(sys.argv) as (rank, world_size, results, save):
        cases = _cases.comparison_cases()
        for case in cases + cases[:1]:
            try:
                results["comparisons"][case.name] = _cases.run_case(case, rank, world_size)
            except Exception:  # noqa: BLE001 - reported to the test
                results["comparisons"][case.name] = {"exception": traceback.format_exc()}
            save()
            if case is cases[-1]:
                for name in _cases.REFUSALS:
                    results["refusals"][name] = _cases.run_refusal(name, rank, world_size)
                    save()
                results["in_place"] = _cases.run_in_place(rank, world_size)
                results["gather_halo"] = _cases.run_gather_halo(rank, world_size)
                save()
        if world_size == 4:  # two groups of 2 side by side: ranks and neighbours are those of the group
            groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            mine = groups[rank // 2]
            for case in _cases.SUBGROUP_CASES:
                try:
                    results["comparisons"]["subgroup:" + case.name] = _cases.run_case(case, rank % 2, 2, mine)
                except Exception:  # noqa: BLE001 - reported to the test
                    results["comparisons"]["subgroup:" + case.name] = {"exception": traceback.format_exc()}
                save()


if __name__ == "__main__":
    main()
