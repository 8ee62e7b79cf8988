"""relbias.nn.MultiheadAttention and patch_t5 with a process group, on 2 gloo processes (CPU), against the
single-process modules on the unsharded inputs (issue 13, item 3).

The two processes are started once for the whole module (a module-scoped fixture) and run every case of
``_module_cases``; the tests read their result files. One torch thread per process, ``file://`` rendezvous in a
fresh temporary folder, loopback only, a 45 s timeout on every collective, a join timeout, the process group
destroyed in a ``finally``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from ._module_cases import MHA_CASES, REFUSALS, T5_CASES, hf_helpers  # noqa: E402
from ._checks import assert_within_bounds  # noqa: E402
from ._spawn import run_ranks  # noqa: E402

WORKER = Path(__file__).with_name("_module_worker.py")
WORLD_SIZE = 2
JOIN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Start the worker processes, wait for them (with a timeout), return each rank's results."""
    folder = tmp_path_factory.mktemp("modules_cp")
    return run_ranks(WORKER, WORLD_SIZE, folder, timeout_s=JOIN_TIMEOUT_S, env={"HF_HUB_OFFLINE": "1"})


def _check(ranks, case):
    assert_within_bounds(ranks, case)


def test_every_rank_finished(ranks):
    for rank, res in enumerate(ranks):
        assert res.get("done") and res["returncode"] == 0, f"rank {rank}: {res['log']}"


@pytest.mark.parametrize("case", [c.name for c in MHA_CASES] + ["after-refusals:" + MHA_CASES[0].name])
def test_multihead_attention_matches_single_process(ranks, case):
    """Output shards, input gradients and every parameter's gradient (projections summed over the ranks; a
    self-attention bias's already summed) equal the single-process layer's to float32 rounding (a bound from eps,
    the longest sum and each tensor's scale: _module_cases._excess)."""
    _check(ranks, case)


@pytest.mark.parametrize("case", [c.name for c in T5_CASES])
def test_t5_matches_single_process(ranks, case):
    """A tiny T5 patched with a process group: encoder output and decoder logits shards, and the gradients of a
    summed cross-entropy for every parameter (bias tables included), equal transformers' unsharded model's."""
    _check(ranks, case)


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals(ranks, name):
    kind, words = REFUSALS[name]
    for rank, res in enumerate(ranks):
        raised = res.get("refusals", {}).get(name)
        assert raised is not None, f"rank {rank}: {name} was not refused"
        assert raised.startswith(kind + ":") and words in raised, raised


def test_settings_checked_without_processes():
    """Bad layouts and strategies are refused at construction; a forward without torch.distributed names it."""
    import torch
    import torch.distributed as dist

    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a process group object; torch.distributed not initialised

    from relbias.integrations.transformers import patch_t5
    from relbias.nn import MultiheadAttention

    with pytest.raises(ValueError, match="layout must be one of"):
        MultiheadAttention(8, 2, process_group=group, cp_layout="striped")
    with pytest.raises(ValueError, match="cp_strategy must be one of"):
        MultiheadAttention(8, 2, process_group=group, cp_strategy="tree")
    layer = MultiheadAttention(8, 2, batch_first=True, process_group=group)
    x = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        layer(x, x, x, need_weights=False)
    with pytest.raises(ValueError, match="need_weights=False"):
        layer(x, x, x)
    conftest = hf_helpers()
    with pytest.raises(ValueError, match="layout must be one of"):
        patch_t5(conftest.tiny_model("t5", "EncoderModel"), process_group=group, layout="striped")
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        patch_t5(conftest.tiny_model("t5", "EncoderModel"), process_group=group)
