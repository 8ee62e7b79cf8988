"""Conversion from :class:`torch.nn.MultiheadAttention`: its configuration and weights into relbias'
:class:`relbias.nn.MultiheadAttention` (:meth:`~relbias.nn.MultiheadAttention.from_torch`), and its state dict's
keys translated for ``load_state_dict``."""

from __future__ import annotations

from torch import nn

from ..biases.base import RelativeBias

__all__ = ["from_torch_layer", "join_names", "translate_torch_state"]


def join_names(names: list[str]) -> str:
    """Join names for a message: ``a``; ``a and b``; ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


#: What :meth:`MultiheadAttention.from_torch` takes from the torch layer, never from its keywords.
_FROM_TORCH = ("embed_dim", "num_heads", "kdim", "vdim", "batch_first", "proj_bias", "device", "dtype")


def translate_torch_state(state: dict, prefix: str, embed_dim: int, errors: list[str]) -> None:
    """Rename (in place) a :class:`torch.nn.MultiheadAttention` state dict's entries under ``prefix`` to relbias'.

    ``in_proj_weight`` (3·E, E) / ``in_proj_bias`` (3·E,) -> ``{q,k,v}_proj.weight`` / ``.bias``, split in that
    order; ``{q,k,v}_proj_weight`` -> ``{q,k,v}_proj.weight``; ``out_proj.*`` already match. What cannot be
    loaded is appended to ``errors`` (``load_state_dict`` raises them, whatever ``strict``): ``bias_k``/``bias_v``,
    a packed tensor without 3·E rows, a torch entry next to the relbias one it would become.
    """
    for name in ("bias_k", "bias_v"):
        if prefix + name in state:
            state.pop(prefix + name)
            errors.append(f"{prefix}{name}: a torch.nn.MultiheadAttention state dict with add_bias_kv=True; relbias' "
                          f"MultiheadAttention has no learned key and value appended to the sequence to load it into")
    renamed = []
    for packed, suffix in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
        tensor = state.pop(prefix + packed, None)
        if tensor is None:
            continue
        if tensor.dim() not in (1, 2) or tensor.shape[0] != 3 * embed_dim:
            errors.append(f"{prefix}{packed} has shape {tuple(tensor.shape)}; expected 3 * embed_dim = "
                          f"{3 * embed_dim} rows (torch's q, k and v projections stacked)")
            continue
        renamed += [(packed, f"{name}_proj.{suffix}", part) for name, part in zip("qkv", tensor.split(embed_dim))]
    for name in "qkv":
        tensor = state.pop(f"{prefix}{name}_proj_weight", None)
        if tensor is not None:
            renamed.append((f"{name}_proj_weight", f"{name}_proj.weight", tensor))
    for source, target, tensor in renamed:
        if prefix + target in state:
            errors.append(f"the state dict has both {prefix}{target} and torch's {prefix}{source}; keep one")
        else:
            state[prefix + target] = tensor


def from_torch_layer(cls: type, module: nn.MultiheadAttention, position_bias: RelativeBias | None, kwargs: dict):
    """:meth:`relbias.nn.MultiheadAttention.from_torch` (``cls``: the class to build); arguments, result and errors
    as documented there."""
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if "bias" in kwargs:
        raise TypeError(f"from_torch takes the relative position bias as position_bias=, got "
                        f"bias={kwargs['bias']!r} (torch's bias, the projection biases, comes from module)")
    taken = [name for name in _FROM_TORCH if name in kwargs]
    if taken:
        given = ", ".join(f"{name}={kwargs[name]!r}" for name in taken)
        raise TypeError(f"from_torch takes {join_names(taken)} from module, got {given}; convert the result instead "
                        f"(e.g. layer.to(dtype))")
    in_bias, out_bias = module.in_proj_bias, module.out_proj.bias
    refused = []
    if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
        refused.append("add_bias_kv=True (bias_k, bias_v: a learned key and value appended to every sequence)")
    if module.add_zero_attn:
        refused.append(f"add_zero_attn={module.add_zero_attn!r} (a zero key and value appended to every sequence)")
    if module.dropout != 0:
        refused.append(f"dropout={module.dropout!r} (relbias' layer has no attention dropout; where the layer runs "
                       f"without it, e.g. for inference, set module.dropout = 0.0 first)")
    if (in_bias is None) != (out_bias is None):
        refused.append(f"in_proj_bias is {'None' if in_bias is None else 'set'} but out_proj.bias is "
                       f"{'None' if out_bias is None else 'set'} (proj_bias is one flag for the four projections)")
    tensors = [*module.parameters(), *module.buffers()]
    for what in ("dtype", "device"):
        found = sorted({str(getattr(t, what)) for t in tensors})
        if len(found) > 1:
            refused.append(f"parameters of several {what}s {found} (convert module to one first, module.to(...))")
    if refused:
        raise ValueError(f"cannot convert this torch.nn.MultiheadAttention: {'; '.join(refused)}; relbias' "
                         f"MultiheadAttention supports none of these")
    kwargs.setdefault("convention", "additive")
    weight = module.out_proj.weight
    layer = cls(
        module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first,
        device=weight.device, dtype=weight.dtype, position_bias=position_bias, proj_bias=in_bias is not None,
        **kwargs,
    )
    missing, unexpected = layer.load_state_dict(module.state_dict(), strict=False)
    missing = [name for name in missing if not name.startswith("position_bias.")]
    if missing or unexpected:
        found = [f"{what} {names}" for what, names in (("has", unexpected), ("leaves unset", missing)) if names]
        raise ValueError(f"cannot convert module ({type(module).__name__}): its state dict {' and '.join(found)}; "
                         f"expected torch.nn.MultiheadAttention's parameters only")
    sources = {"out_proj.weight": weight, "out_proj.bias": out_bias}
    for name in "qkv":
        packed = module.in_proj_weight
        sources[f"{name}_proj.weight"] = getattr(module, f"{name}_proj_weight") if packed is None else packed
        sources[f"{name}_proj.bias"] = in_bias
    for name, parameter in layer.named_parameters():
        if sources.get(name) is not None:
            parameter.requires_grad_(sources[name].requires_grad)
    return layer.train(module.training)
