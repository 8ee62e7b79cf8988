"""Training with FSDP2 and context parallelism on a 2-D DeviceMesh: relbias' ByteLM or a tiny T5.

The mesh has a "dp" dimension (data parallel: each dp rank trains on its own rows of the batch) and a "cp" dimension
(context parallel: the ranks of a "cp" group hold one sequence's shards and run relbias' ring attention over it).
Parameters, gradients and optimizer state are sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``) over every
rank, the flattened dp x cp mesh, as torchtitan composes them (its ``dp_shard_cp`` mesh). FSDP2 averages every
gradient over those ranks, so each rank's loss is the mean over its own tokens (equal token counts per rank make
the average of these means the global mean) and every gradient, the relative-bias tables' included, must be the
rank's own part: attention is built with ``cp_sync_bias_grads=False`` (``patch_t5(..., sync_bias_grads=False)``),
else the bias gradients, already summed over "cp" inside attention, would be counted cp times.

Run (CPU, gloo; NCCL on GPUs: ``--backend nccl --device cuda``, not run on GPUs here)::

    torchrun --nproc-per-node 4 examples/fsdp_context_parallel.py --dp 2 --cp 2 --model bytelm --position t5

It prints each step's loss (the mean over every rank's tokens). The same functions back the tests
(tests/distributed/test_fsdp_cp.py: 5 AdamW steps with gradient clipping equal a single-process run on the whole
batch) and the benchmark (benchmarks/bench_fsdp_cp.py).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import relbias
from relbias.distributed import shard
from relbias.experiments import ByteLM, ByteLMConfig


def make_meshes(dp: int, cp: int, device: str = "cpu") -> tuple[DeviceMesh, DeviceMesh]:
    """The 2-D ("dp", "cp") mesh and the 1-D mesh FSDP2 shards over: every rank, in the 2-D mesh's (row-major)
    order, i.e. the flattened dp x cp dimension."""
    if dist.get_world_size() != dp * cp:
        raise ValueError(f"dp x cp = {dp} x {cp} = {dp * cp} ranks, but the world has {dist.get_world_size()}")
    mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, init_device_mesh(device, (dp * cp,), mesh_dim_names=("dp_cp",))


def bytelm_config(position: str, seq_len: int) -> ByteLMConfig:
    """A small ByteLM: 2 layers, width 64, 4 heads, trained at ``seq_len`` tokens."""
    return ByteLMConfig(position=position, max_len=seq_len, embed_dim=64, num_heads=4, num_layers=2)


def build_bytelm(config: ByteLMConfig, mesh: DeviceMesh | None, fsdp_mesh: DeviceMesh | None, *, seed: int = 0,
                 layout: str = "zigzag", reshard_after_forward: bool = True, device: str = "cpu") -> torch.nn.Module:
    """ByteLM initialised from ``seed`` on ``device``; with meshes, context parallel over ``mesh["cp"]`` and FSDP2
    over ``fsdp_mesh`` (one FSDP group at the root: the layers share one bias module, which per-layer groups would
    free between its uses)."""
    torch.manual_seed(seed)
    if mesh is None:
        return ByteLM(config).to(device)
    model = ByteLM(config, process_group=mesh["cp"], cp_layout=layout, cp_sync_bias_grads=False).to(device)
    return fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)


def build_t5(mesh: DeviceMesh | None, fsdp_mesh: DeviceMesh | None, *, seed: int = 0, layout: str = "zigzag",
             reshard_after_forward: bool = True, device: str = "cpu") -> torch.nn.Module:
    """A tiny ``T5ForConditionalGeneration`` (2 layers, width 32, 4 heads, dropout 0) from a config, seeded, patched
    with relbias; with meshes, its sequences sharded over ``mesh["cp"]`` and FSDP2 over ``fsdp_mesh``."""
    import transformers

    from relbias.integrations.transformers import patch_t5

    config = transformers.T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=32,
                                   dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).to(device)
    if mesh is None:
        return patch_t5(model)
    patch_t5(model, process_group=mesh["cp"], layout=layout, sync_bias_grads=False)
    return fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)


def text_batches(steps: int, rows: int, seq_len: int, *, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches of ``rows`` windows of ``seq_len + 1`` bytes (inputs and next-byte targets) of Python's
    own documentation text (``pydoc_data.topics``), at seeded random offsets: int64 (rows, seq_len + 1)."""
    from pydoc_data.topics import topics

    data = torch.tensor(list("".join(topics.values()).encode("utf-8")), dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len - 1, (steps, rows), generator=generator)
    return [torch.stack([data[s : s + seq_len + 1] for s in row.tolist()]) for row in starts]


def local_rows(batch: torch.Tensor, mesh: DeviceMesh | None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of a global batch (rows, L + 1): its dp rank's rows, then its cp shard of the inputs and of
    the targets, returned stacked as (2, rows/dp, L/cp). Without a mesh: the whole batch, (2, rows, L)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if mesh is None:
        return torch.stack([inputs, targets])
    dp, cp = mesh["dp"], mesh["cp"]
    rows = batch.shape[0] // dp.size()
    part = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
    return torch.stack([shard(t[part], cp.size(), cp.get_local_rank(), layout=layout, dim=1) for t in (inputs, targets)])


def loss_of(model: torch.nn.Module, rows: torch.Tensor, kind: str) -> torch.Tensor:
    """The mean next-token cross-entropy over the rows' tokens (nats); ``rows`` = (inputs, targets) from
    :func:`local_rows`. ByteLM reads the inputs; T5 reads them as both the encoder's and the decoder's input ids."""
    inputs, targets = rows.to(next(model.parameters()).device)
    if kind == "bytelm":
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    logits = model(input_ids=inputs, decoder_input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model: torch.nn.Module, batches: list[torch.Tensor], mesh: DeviceMesh | None, kind: str, *,
          lr: float = 3e-3, eps: float = 1e-8, max_norm: float = 0.5,
          layout: str = "zigzag") -> tuple[list[float], torch.optim.Optimizer]:
    """AdamW steps (``lr``, ``eps``, weight decay 0.01) with gradient clipping by total norm (``max_norm``), one per
    batch; returns the losses (the mean over every rank's tokens, read after each step's forward) and the
    optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.01)
    losses = []
    for batch in batches:
        loss = loss_of(model, local_rows(batch, mesh, layout), kind)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss.detach(), mesh))
    return losses, optimizer


def global_mean(loss: torch.Tensor, mesh: DeviceMesh | None) -> float:
    """The mean of every rank's loss (the global mean when every rank holds as many tokens)."""
    if mesh is None:
        return loss.item()
    total = loss.clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (FSDP2's DTensors gathered), by name."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--model", choices=("bytelm", "t5"), default="bytelm")
    parser.add_argument("--position", default="t5", help="ByteLM's bias family (relbias.biases.FAMILIES)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (divisible by 2 x cp)")
    parser.add_argument("--rows", type=int, default=4, help="sequences per step, over every dp rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        if args.device == "cuda":  # one GPU per process
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        mesh, fsdp_mesh = make_meshes(args.dp, args.cp, args.device)
        if args.model == "bytelm":
            model = build_bytelm(bytelm_config(args.position, args.seq_len), mesh, fsdp_mesh, device=args.device)
        else:
            model = build_t5(mesh, fsdp_mesh, device=args.device)
        losses, _ = train(model, text_batches(args.steps, args.rows, args.seq_len), mesh, args.model)
        if dist.get_rank() == 0:
            for step, loss in enumerate(losses, 1):
                print(f"step {step}: loss {loss:.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
