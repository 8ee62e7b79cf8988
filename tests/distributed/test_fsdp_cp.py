"""FSDP2 composed with context parallelism on a 2 x 2 ("dp", "cp") DeviceMesh (4 gloo processes, CPU), the recipe of
examples/fsdp_context_parallel.py: 5 AdamW steps with gradient clipping equal a single-process run on the whole
batch, bias tables included, with ``reshard_after_forward`` on and off; a torch.distributed.checkpoint saved on the
mesh loads into the same mesh and into one process with the same parameters and the same next loss.

The processes start once for the module (a module-scoped fixture, ``_spawn.run_ranks``: one torch thread each, a
fresh ``file://`` rendezvous, loopback only, timeouts on every collective and on the join).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._fsdp_cases import ADAM_EPS, CASES, CHECKPOINTED, STEPS, batches, build, recipe
from ._spawn import run_ranks

WORKER = Path(__file__).with_name("_fsdp_worker.py")
JOIN_TIMEOUT_S = 300
ATOL = 1e-5  # float32: the sums over 4 ranks and over the whole batch round differently; 5 Adam steps of lr 3e-3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Start the 4 ranks, wait for them, return (their results, the folder of rank 0's saved tensors)."""
    folder = tmp_path_factory.mktemp("fsdp_cp")
    return run_ranks(WORKER, 4, folder, timeout_s=JOIN_TIMEOUT_S, env={"HF_HUB_OFFLINE": "1"}), folder


def _saved(trained, name):
    ranks, folder = trained
    for rank, res in enumerate(ranks):
        got = res.get("comparisons", {}).get(name)
        assert got is not None, f"rank {rank} did not run {name}: {res['log']}"
        assert "exception" not in got, got["exception"]
    return torch.load(folder / f"{name}.pt")


@pytest.fixture(scope="module")
def single_process():
    """Each case trained in this process on the whole batch: {name: (losses, final parameters, model)}."""
    if any(case.kind == "t5" for case in CASES):
        pytest.importorskip("transformers")
    out = {}
    for case in CASES:
        if case.sync_bias_grads:
            continue
        model = build(case, None, None)
        losses, _ = recipe().train(model, batches()[:STEPS], None, case.kind, eps=ADAM_EPS)
        out[case.name] = (losses, recipe().full_parameters(model), model)
    return out


def test_every_rank_finished(trained):
    for rank, res in enumerate(trained[0]):
        assert res.get("done") and res["returncode"] == 0, f"rank {rank}: {res['log']}"


@pytest.mark.parametrize("name", [case.name for case in CASES if not case.sync_bias_grads])
def test_training_equals_single_process(trained, single_process, name):
    saved = _saved(trained, name)
    losses, params, _ = single_process[name]
    assert len(saved["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(saved["losses"]), torch.tensor(losses), atol=ATOL, rtol=0)
    assert saved["params"].keys() == params.keys()
    moved = 0
    for key, value in params.items():
        if key.endswith("k_proj.bias"):
            # the key projection's bias adds q . b_k to every score of a query's row, which softmax cancels: its
            # gradient is 0 in exact arithmetic, and rounding noise of ~1e-9, which AdamW normalises into steps of
            # about lr, differs between any two summation orders. Not a quantity either run determines.
            continue
        torch.testing.assert_close(saved["params"][key], value, atol=ATOL, rtol=0, msg=lambda m: f"{key}: {m}")
        moved += key.endswith("relative_attention_bias.weight") or "position_biases" in key
    if name.startswith("bytelm-t5") or name.startswith("bytelm-offset") or name == "t5":
        assert moved, "the case trains a bias table: it must be among the compared parameters"


def test_summing_bias_gradients_twice_is_caught(trained, single_process):
    """The naive composition (bias gradients summed over "cp" inside attention, then averaged over dp x cp by
    FSDP2) counts the table's gradient twice: the table ends far from the single-process run's (AdamW's step is
    nearly invariant to a gradient's scale, but clipping by the total norm and eps are not), so the equality above is
    a check that can fail."""
    naive, (_, params, _) = _saved(trained, "bytelm-t5-naive"), single_process["bytelm-t5"]
    table = next(k for k in params if "position_biases" in k)
    assert (naive["params"][table] - params[table]).abs().max() > 10 * ATOL


def test_checkpoint_loads_into_the_same_mesh(trained, single_process):
    saved = _saved(trained, CHECKPOINTED)
    for key, value in saved["params"].items():
        torch.testing.assert_close(saved["loaded_params"][key], value, atol=0, rtol=0)
    _, _, model = single_process[CHECKPOINTED]
    expected = recipe().loss_of(model, recipe().local_rows(batches()[-1], None), "bytelm").item()
    assert abs(saved["next_loss"] - expected) < ATOL


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the no-dist load says so
def test_checkpoint_loads_into_one_process(trained):
    """The sharded checkpoint read without a process group (torch.distributed.checkpoint's no-dist load) into a
    plain ByteLM: the same parameters as on the mesh, and the same next loss."""
    import torch.distributed.checkpoint as dcp

    saved = _saved(trained, CHECKPOINTED)
    case = next(c for c in CASES if c.name == CHECKPOINTED)
    model = build(case, None, None, seed=1)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=saved["checkpoint"], no_dist=True)
    model.load_state_dict(state["model"])
    for key, value in saved["params"].items():
        torch.testing.assert_close(dict(model.named_parameters())[key].detach(), value, atol=0, rtol=0)
    loss = recipe().loss_of(model, recipe().local_rows(batches()[-1], None), "bytelm").item()
    assert abs(loss - saved["next_loss"]) < ATOL
