"""One rank of the FSDP2 x context-parallel tests: ``python _fsdp_worker.py RANK WORLD_SIZE INIT_FILE OUT_JSON``.

A gloo process group through a ``file://`` rendezvous (loopback, one torch thread, a timeout on every collective,
always destroyed: ``_spawn.rank_session``); a 2 x 2 ("dp", "cp") mesh; every case of ``_fsdp_cases`` trained for
its steps. Rank 0 saves each case's losses and unsharded final parameters next to OUT_JSON (``CASE.pt``); the
checkpointed case is saved with torch.distributed.checkpoint, loaded into a fresh model on the same mesh, and its
next loss recorded.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402

import _fsdp_cases as cases  # noqa: E402  (this script's folder is sys.path[0])
from _spawn import rank_session  # noqa: E402


def run(case, rank, folder: Path, mesh, fsdp_mesh, results) -> None:
    r = cases.recipe()
    data = cases.batches()
    model = cases.build(case, mesh, fsdp_mesh)
    losses, _ = r.train(model, data[: cases.STEPS], mesh, case.kind, eps=cases.ADAM_EPS)
    saved = {"losses": losses, "params": r.full_parameters(model)}
    if case.name == cases.CHECKPOINTED:
        checkpoint = folder / "checkpoint"
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(checkpoint))
        fresh = cases.build(case, mesh, fsdp_mesh, seed=1)  # other weights, until loaded
        state = {"model": get_model_state_dict(fresh)}
        dcp.load(state, checkpoint_id=str(checkpoint))
        set_model_state_dict(fresh, state["model"])
        saved["loaded_params"] = r.full_parameters(fresh)
        saved["next_loss"] = r.global_mean(r.loss_of(fresh, r.local_rows(data[-1], mesh), case.kind).detach(), mesh)
        saved["checkpoint"] = str(checkpoint)
    if rank == 0:
        torch.save(saved, folder / f"{case.name}.pt")
    results["comparisons"][case.name] = {"ran": True}


def main() -> None:
    folder = Path(sys.argv[4]).parent
    with rank_session(sys.argv) as (rank, world_size, results, save):
        mesh, fsdp_mesh = cases.recipe().make_meshes(cases.DP, cases.CP)
        for case in cases.CASES:
            try:
                run(case, rank, folder, mesh, fsdp_mesh, results)
            except Exception:  # noqa: BLE001 - reported to the test
                results["comparisons"][case.name] = {"exception": traceback.format_exc()}
            save()


if __name__ == "__main__":
    main()
