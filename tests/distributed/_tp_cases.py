"""Cases of the tensor-parallel tests: a patched T5 whose attention layers are sharded by heads with
``torch.distributed.tensor.parallel.parallelize_module`` (q, k, v column-wise, o row-wise) on a "tp" mesh of 2
ranks, alone or beside a "cp" dimension of 2 (4 ranks), against the single-process patched model: outputs and every
parameter's gradient. Shared by test_tensor_parallel.py (names) and _tp_worker.py (running them)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relbias.distributed import shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare import excess, grad_errors, seq2seq_step  # noqa: E402

B = 2


def hf_helpers():
    """tests/integrations/conftest.py (tiny_model, batch), loaded under its own name."""
    name = "_relbias_tiny_t5_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "integrations/conftest.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


@dataclass(frozen=True)
class TpCase:
    name: str
    family: str = "t5"
    sync_bias_grads: bool = True
    context_parallel: bool = False  # 4 ranks only: a 2 x 2 ("cp", "tp") mesh


CASES = [
    TpCase("t5-tp"),
    TpCase("umt5-tp", family="umt5"),  # a table per layer
    TpCase("t5-tp-unsynced", sync_bias_grads=False),
    TpCase("t5-tp-cp", context_parallel=True),
]

REFUSALS = {
    # refused by patch_t5 itself, before any forward (the worker runs none after it)
    "heads_not_sharded": ("ValueError", "encoder.block.0.layer.0.SelfAttention is not sharded so: n_heads is 4, "
                                        "inner_dim is 32, q has 32 output features"),
    # the projections sharded, n_heads and inner_dim left whole: transformers' cross-attention would fail on shapes
    "head_count_left_whole": ("ValueError", "is not sharded so: n_heads is 4, inner_dim is 32 (expected"),
    "heads_not_divisible": ("ValueError", "must be divisible by"),
}


def shard_heads(model, tp_mesh) -> None:
    """The recipe of docs/context-parallel.md: every T5 attention layer's q, k, v column-wise and o row-wise, and its
    head count and inner dimension set to this rank's share."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers.models.t5.modeling_t5 import T5Attention
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    size = tp_mesh.size()
    for module in model.modules():
        if isinstance(module, (T5Attention, UMT5Attention)):
            parallelize_module(module, tp_mesh, plan)
            module.n_heads //= size
            module.inner_dim //= size


def applies(case: TpCase, world_size: int) -> bool:
    """A 2 x 2 ("cp", "tp") mesh needs 4 processes; the rest run on every group size."""
    return not case.context_parallel or world_size == 4


def run_case(case: TpCase, rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from relbias.integrations.transformers import patch_t5

    hf = hf_helpers()
    if case.context_parallel:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        cp_group, cp_size, cp_rank = mesh["cp"], 2, mesh["cp"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        cp_group, cp_size, cp_rank = None, 1, 0
    ref = patch_t5(hf.tiny_model(case.family))
    model = hf.tiny_model(case.family)
    shard_heads(model, mesh["tp"])
    model = patch_t5(model, tensor_parallel=mesh["tp"], process_group=cp_group, sync_bias_grads=case.sync_bias_grads)
    input_ids, attention_mask = hf.batch(batch_size=B, length=32, pad_last=7, seed=6)
    dec_ids, dec_mask = hf.batch(batch_size=B, length=16, pad_last=3, seed=2)
    labels, _ = hf.batch(batch_size=B, length=16, seed=3)

    def local(t):
        return t if cp_size == 1 else shard(t, cp_size, cp_rank, dim=1)

    want = seq2seq_step(ref, input_ids, attention_mask, dec_ids, dec_mask, labels)
    got = seq2seq_step(model, *(local(t) for t in (input_ids, attention_mask, dec_ids, dec_mask, labels)))
    tokens = B * 32
    errors = {"encoder": excess(got.encoder_last_hidden_state, local(want.encoder_last_hidden_state), tokens),
              "logits": excess(got.logits, local(want.logits), tokens)}
    tp_group = mesh["tp"].get_group()

    def whole(name, grad):
        table = name.endswith("relative_attention_bias.weight")
        if isinstance(grad, DTensor):  # a sharded projection: its shards' gradients, whole
            grad = grad.full_tensor()
        elif table and not case.sync_bias_grads:  # each rank its heads' columns: sum them
            grad = grad.clone()
            dist.all_reduce(grad, group=tp_group)
            if cp_group is not None:
                dist.all_reduce(grad, group=cp_group.get_group())
        if cp_group is not None and not table:  # the sequence shards' parts, summed
            grad = grad.clone()
            dist.all_reduce(grad, group=cp_group.get_group())
        return grad

    errors.update(grad_errors(model, ref, tokens, whole))
    if not case.sync_bias_grads:  # each rank's table gradient holds only its heads' columns
        per = 4 // mesh["tp"].size()  # the tiny model's 4 heads over the group
        start = mesh["tp"].get_local_rank() * per
        for name, p in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                others = torch.cat([p.grad[:, :start], p.grad[:, start + per:]], dim=1)
                errors["other_heads_zero:" + name] = others.abs().max().item()
    return {"errors": errors}


def run_refusal(name: str, rank: int, world_size: int) -> str | None:
    from torch.distributed.device_mesh import init_device_mesh

    from relbias.integrations.transformers import patch_t5

    hf = hf_helpers()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    try:
        if name == "heads_not_divisible":
            patch_t5(hf.tiny_model("t5", num_heads=3 if world_size == 2 else 6), tensor_parallel=mesh["tp"])
            return None
        model = hf.tiny_model("t5")
        if name == "head_count_left_whole":  # the projections sharded only: every n_heads and inner_dim whole
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            from transformers.models.t5.modeling_t5 import T5Attention

            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
            for module in model.modules():
                if isinstance(module, T5Attention):
                    parallelize_module(module, mesh["tp"], plan)
        patch_t5(model, tensor_parallel=mesh["tp"])  # raises here, before any forward
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks type and message
        return f"{type(exc).__name__}: {exc}"
    return None
