"""``patch_t5(tensor_parallel=...)``'s check of the caller's half of the recipe, at patch time: every T5-style
attention layer (self- and cross-attention) sharded by heads, so that a model set up halfway is refused by name
before its first forward (where transformers' cross-attention would fail with a shape mismatch instead).

The recipe (Shoeybi et al. 2019, Megatron-LM, §3; docs/context-parallel.md): ``q``, ``k``, ``v`` column-wise and
``o`` row-wise (``torch.distributed.tensor.parallel.parallelize_module``), ``n_heads`` set to H/T and ``inner_dim``
to H/T x d_kv on each layer.
"""

from __future__ import annotations

from torch import nn

__all__ = ["check_sharded_heads", "recipe"]


def recipe(per: int, d_kv: int) -> str:
    """The recipe's steps for ``per`` heads a rank of ``d_kv`` features each, as the refusals give them."""
    return (f"shard q, k and v column-wise and o row-wise (torch.distributed.tensor.parallel.parallelize_module) and "
            f"set each attention module's n_heads to {per} and inner_dim to {per} x d_kv = {per * d_kv} "
            f"(docs/context-parallel.md, tensor parallelism)")


def _local_shape(linear: nn.Module) -> tuple[int, ...]:
    """The shape of this rank's part of ``linear.weight`` (a DTensor's local shard, else the whole weight)."""
    weight = linear.weight
    to_local = getattr(weight, "to_local", None)
    return tuple((to_local() if to_local is not None else weight).shape)


def _layer_faults(module: nn.Module, per: int) -> list[str]:
    """What is not sharded to ``per`` heads in one attention layer (empty: sharded as the recipe says)."""
    d_kv = module.key_value_proj_dim
    inner = per * d_kv
    faults = []
    if module.n_heads != per:
        faults.append(f"n_heads is {module.n_heads}")
    if module.inner_dim != inner:
        faults.append(f"inner_dim is {module.inner_dim}")
    for name, axis in (("q", 0), ("k", 0), ("v", 0), ("o", 1)):
        features = _local_shape(getattr(module, name))[axis]
        if features != inner:
            side = "output" if axis == 0 else "input"
            faults.append(f"{name} has {features} {side} features on this rank")
    return faults


def check_sharded_heads(model: nn.Module, attention_cls: type, num_heads: int, tp_size: int) -> None:
    """Check that every ``attention_cls`` layer in ``model`` computes this rank's H/T heads.

    Args:
        model: the module holding the T5-family stacks (self- and cross-attention layers are checked).
        attention_cls: the stacks' attention class (``T5Attention``, ``UMT5Attention``, ...).
        num_heads: H, the heads of the model's relative-bias table.
        tp_size: T, the tensor-parallel group's size (H divisible by T, checked before).

    Raises:
        ValueError: a layer whose ``n_heads``, ``inner_dim`` or projections' local shards do not hold H/T heads; the
            message names the first such layer, what it found and the recipe's steps.
    """
    per = num_heads // tp_size
    for name, module in model.named_modules():
        if not isinstance(module, attention_cls):
            continue
        faults = _layer_faults(module, per)
        if faults:
            d_kv = module.key_value_proj_dim
            raise ValueError(
                f"patch_t5(tensor_parallel=...) over {tp_size} ranks gives each rank {per} of the {num_heads} heads, "
                f"but {name} is not sharded so: {', '.join(faults)} (expected {per} heads, {per * d_kv} features); "
                + recipe(per, d_kv)
            )
