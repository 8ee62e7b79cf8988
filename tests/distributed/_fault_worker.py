"""One rank of the fault tests: ``FAULT=name python _fault_worker.py RANK WORLD_SIZE INIT_FILE OUT_JSON``.

Joins a gloo group with a short timeout on every collective (``GROUP_TIMEOUT_S``), makes one context-parallel call in
which the last rank fails as ``FAULT`` says (``raise_mid_ring``: it raises at its second ring block and its process
ends, closing its connections; ``skip_backward``: it returns without its part of backward and stays alive, so the
others' waits end at the group's timeout; ``raise_mid_halo`` and ``skip_backward_halo``: the same with strategy
"halo" and a causal window of 4 keys, the second block being the one against its left halo), records what each rank raised and after how long, and destroys the
group. No barrier at the end: after a fault the ranks do not meet again.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402

import relbias  # noqa: E402
from relbias.distributed import context_parallel_attention  # noqa: E402
from relbias.distributed.halo import attention as halo  # noqa: E402
from relbias.distributed.ring import attention as ring  # noqa: E402

from _spawn import rank_session  # noqa: E402  (this script's folder is sys.path[0])

GROUP_TIMEOUT_S = 5.0


def _fail_at_second_block(run_block):
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault in this rank's second block")
        return run_block(*args, **kwargs)

    return failing


def main() -> None:
    fault = os.environ["FAULT"]
    with rank_session(sys.argv, timeout_s=GROUP_TIMEOUT_S, barrier=False) as (rank, world_size, results, save):
        faulty = rank == world_size - 1
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        bias = relbias.T5Bias(2, num_buckets=8, max_distance=16)
        module = halo if fault.endswith("halo") else ring
        if fault.startswith("raise") and faulty:
            module.run_block = _fail_at_second_block(module.run_block)
        kwargs = dict(strategy="halo", window=(3, 0), is_causal=True) if module is halo else dict(kv_chunks=1)
        start = time.monotonic()
        try:
            out = context_parallel_attention(q, k, v, bias=bias, **kwargs)
            if not (fault.startswith("skip_backward") and faulty):  # that rank returns without its part of backward
                out.sum().backward()
            results["raised"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test, which checks type and message
            results["raised"] = f"{type(exc).__name__}: {exc}"
        results["seconds"] = time.monotonic() - start
        save()
        if fault.startswith("skip_backward") and faulty:  # alive, as a process that went on: the others' waits time out
            time.sleep(3 * GROUP_TIMEOUT_S)


if __name__ == "__main__":
    main()
