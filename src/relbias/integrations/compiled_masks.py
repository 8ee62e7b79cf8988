"""transformers' masks under ``torch.compile``: converted when the graph runs, inside one custom op.

In eager mode :func:`relbias.integrations.masks.relbias_mask_from_hf` reads a transformers 4D mask's values to
find the form relbias' fast backends take, a (B, 1, 1, Lk) key padding mask plus the causal rule. A compiled graph
cannot branch on values, so there the mask went on whole and a patched model with a padding mask ran on the tiled
``blockwise`` backend. :func:`compiled_hf_attention` instead hands the call to the custom op
``relbias::hf_masked_attention``, opaque to the compiler: when the graph runs, the op converts the mask as eager
code does and runs :func:`relbias.attention` on the form found (toeplitz for a key padding mask; the exact mask
otherwise). The bias goes in as a tensor, its values at the call's offsets (computed in the graph from the model's
parameters), so the op holds no module.

Training too: the op's backward (``relbias::hf_masked_attention_backward``) converts the mask again and runs the
call once more with autograd on, returning the gradients of the query, key, value, the bias's values (which the graph
carries on to the bias's parameters) and a per-key bias: a recomputation of the forward, as activation checkpointing
does, so that a padded training step runs the fused kernels' backward instead of the tiled ``blockwise`` one.
Attention dropout draws its mask seed in the graph, as an eager call draws it; the backward drops the entries the
forward dropped with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch
from torch._C import DispatchKey

from ..biases.function import FunctionBias
from ..call import _dropout, make_call
from ..dispatch import pick_backend
from ..positions import resolve_alignment
from .masks import dense_key_bias, hf_visible, offsets_count_positions, relbias_mask_from_hf

__all__ = ["compiled_hf_attention", "hf_masked_attention", "hf_masked_attention_backward"]


@torch.library.custom_op("relbias::hf_masked_attention", mutates_args=())
def hf_masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hf_mask: torch.Tensor,
                        offset_values: torch.Tensor, key_bias: torch.Tensor | None, query_start: int, is_causal: bool,
                        bidirectional: bool, scale: float | None, convention: str, backend: str,
                        enable_gqa: bool, dropout_p: float, seed: torch.Tensor) -> torch.Tensor:
    """:func:`relbias.attention` under a transformers 4D mask converted by ``relbias_mask_from_hf`` when it runs.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) and (B, Hkv, Lk, Dv); keys at positions 0 .. Lk-1.
        hf_mask: transformers' mask, bool (True = may attend) or additive float, (B, 1, Lq, Lk).
        offset_values: the relative bias at the call's offsets ``query_start - (Lk - 1) ... query_start + Lq - 1``
            in ascending order, float (H or 1, Lq + Lk - 1), logits.
        key_bias: None, or for a model that counts positions over visible tokens (BLOOM, Falcon) its own per-key bias
            (B, H, 1, Lk) in logits after scaling: used, dense with the mask and without ``offset_values``, unless
            the offsets stand for those positions (the causal rule and each row's visible keys in one run), as the
            eager patches decide (:mod:`relbias.integrations.alibi_common`).
        query_start: position of the first query (tokens); is_causal: the attention's causal rule (the mask holds
            it too, as transformers builds it); bidirectional: whether the bias is defined for future keys.
        scale, convention, backend, enable_gqa, dropout_p: as :func:`relbias.attention`'s.
        seed: 0-dim integer tensor: with ``dropout_p`` > 0, the call's mask seed (:class:`relbias._dropout.Dropout`),
            drawn in the graph as an eager call draws its own; the backward drops the same entries with it.

    Returns:
        (B, H, Lq, Dv) contiguous, query's dtype. A query row with no visible key gives zeros (relbias' rule).
    """
    with _eager_dispatch(), torch.no_grad():  # the backward recomputes: nothing to record here
        return _run(query, key, value, hf_mask, offset_values, key_bias, query_start, is_causal, bidirectional, scale,
                    convention, backend, enable_gqa, dropout_p, seed)


@torch.library.custom_op("relbias::hf_masked_attention_backward", mutates_args=())
def hf_masked_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 hf_mask: torch.Tensor, offset_values: torch.Tensor, key_bias: torch.Tensor | None,
                                 query_start: int, is_causal: bool, bidirectional: bool, scale: float | None,
                                 convention: str, backend: str, enable_gqa: bool, dropout_p: float,
                                 seed: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of :func:`hf_masked_attention` (same arguments, after ``grad_out`` (B, H, Lq, Dv)): ``[dquery,
    dkey, dvalue, doffset_values, dkey_bias]``, each of its input's shape and dtype (``dkey_bias`` empty without a
    per-key bias). Recomputes the call with autograd on (the mask converted again, the same dropout seed) and
    differentiates it: the backend's own backward (toeplitz's native one for a key padding mask on CPU)."""
    with _eager_dispatch(autograd=True), torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (query, key, value, offset_values)]
        per_key = None if key_bias is None else key_bias.detach().requires_grad_()
        out = _run(*inputs[:3], hf_mask, inputs[3], per_key, query_start, is_causal, bidirectional, scale, convention,
                   backend, enable_gqa, dropout_p, seed)
        wrt = inputs + ([] if per_key is None else [per_key])
        grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
    grads = [t.new_zeros(t.shape) if g is None else g.to(t.dtype).contiguous() for g, t in zip(grads, wrt)]
    return grads if per_key is not None else grads + [query.new_empty(0)]


@hf_masked_attention_backward.register_fake
def _(grad_out, query, key, value, hf_mask, offset_values, key_bias, *settings):
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            offset_values.new_empty(offset_values.shape),
            query.new_empty(0) if key_bias is None else key_bias.new_empty(key_bias.shape)]  # contiguous


def _setup_context(ctx, inputs, output):
    query, key, value, hf_mask, offset_values, key_bias, *settings = inputs
    ctx.save_for_backward(query, key, value, hf_mask, offset_values, key_bias, settings[-1])
    ctx.settings = settings[:-1]  # the scalars; the seed is a saved tensor


def _backward(ctx, grad_out):
    query, key, value, hf_mask, offset_values, key_bias, seed = ctx.saved_tensors
    dq, dk, dv, dvalues, dkey_bias = hf_masked_attention_backward(
        grad_out.contiguous(), query, key, value, hf_mask, offset_values, key_bias, *ctx.settings, seed)
    return dq, dk, dv, None, dvalues, None if key_bias is None else dkey_bias, *([None] * (len(ctx.settings) + 1))


hf_masked_attention.register_autograd(_backward, setup_context=_setup_context)


#: What a dispatch mode's handler excludes beyond an eager call below autograd: the keys before Python's.
_ABOVE_PYTHON = tuple(getattr(DispatchKey, name) for name in (
    "FuncTorchDynamicLayerBackMode", "Functionalize", "Conjugate", "Negative", "ZeroTensor", "ADInplaceOrView", "Tracer",
    "FuncTorchBatched", "BatchedNestedTensor", "FuncTorchVmapMode", "Batched", "VmapMode", "FuncTorchGradWrapper",
    "DeferredInit", "PythonTLSSnapshot", "FuncTorchDynamicLayerFrontMode", "PreDispatch") if hasattr(DispatchKey, name))


#: The autograd keys a custom op's kernel runs without (PyTorch dispatches it below autograd).
_AUTOGRAD = tuple(getattr(DispatchKey, name) for name in (
    "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor") if hasattr(DispatchKey, name))


def _eager_dispatch(autograd: bool = False):
    """The dispatch state of an eager call for the op's work. A compiled graph's first call runs each custom op
    inside a dispatch mode's handler (PyTorch's aliasing check), which excludes every key before Python's: there
    vmap (flex's block masks) fails, and a backend's one-time self-test would record a refusal for the whole process.
    ``autograd``: also the autograd keys, which every custom op's kernel runs without (for the backward's
    recomputation). Elsewhere nothing changes."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    keys = (_ABOVE_PYTHON if exclude.has(DispatchKey.FuncTorchDynamicLayerBackMode) else ()) + \
        (_AUTOGRAD if autograd else ())
    if not keys:
        return contextlib.nullcontext()
    for key in keys:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _run(query, key, value, hf_mask, offset_values, key_bias, query_start, is_causal, bidirectional, scale,
         convention, backend, enable_gqa, dropout_p, seed) -> torch.Tensor:
    """:func:`hf_masked_attention`'s work."""
    mask, causal = relbias_mask_from_hf(hf_mask, is_causal=is_causal, query_start=query_start)
    call = dict(scale=scale, query_start=query_start, key_start=0, enable_gqa=enable_gqa, dropout_p=dropout_p,
                generator=torch.Generator() if dropout_p else None)  # draws nothing from torch's global generator
    end = query_start + query.shape[2]
    if key_bias is not None and not offsets_count_positions(mask, causal, end):
        dense = dense_key_bias(key_bias, hf_mask)  # (B, H, Lq, Lk)
        call.update(mask=dense, is_causal=False)
    else:
        low = query_start - (key.shape[2] - 1)
        bias = FunctionBias(functools.partial(_lookup, offset_values, low), num_heads=offset_values.shape[0],
                            bidirectional=bidirectional)
        call.update(bias=bias, mask=mask, is_causal=causal, convention=convention)
    run = make_call(query, key, value, **call)
    if run.dropout is not None:  # the seed drawn in the graph (as an eager call draws its own): the backward's too
        run = run.replaced(dropout=dataclasses.replace(run.dropout, seed=int(seed)))
    chosen = pick_backend(backend, run)
    return chosen.forward(run)[0].contiguous()


def _lookup(offset_values: torch.Tensor, low: int, offsets: torch.Tensor) -> torch.Tensor:
    """The values at ``offsets`` (any shape): (H or 1, *offsets.shape); an offset outside the call's raises."""
    index = offsets - low
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= offset_values.shape[1]):
        raise IndexError(f"offsets {int(offsets.min())} .. {int(offsets.max())} outside the call's {low} .. "
                         f"{low + offset_values.shape[1] - 1}")
    return offset_values[:, index]


@hf_masked_attention.register_fake
def _(query, key, value, hf_mask, offset_values, key_bias, query_start, is_causal, bidirectional, scale, convention,
      backend, enable_gqa, dropout_p, seed):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


#: Backends the op's bias, values looked up at the call's offsets, cannot serve: ``structured`` reads how far a family's
#: values change (``far_constant_distance``), which the lookup does not carry. A layer patched for one passes the mask
#: whole under compile, as before.
_NOT_TAKEN = ("structured",)


def compiled_hf_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          hf_mask: torch.Tensor | None, *, bias, is_causal: bool, query_start: int | torch.Tensor,
                          scale: float | None, convention: str, backend: str | None, dropout_p: float,
                          enable_gqa: bool = False,
                          key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """Under ``torch.compile``: :func:`hf_masked_attention` of this call (differentiable); None elsewhere.

    Args:
        query, key, value: as :func:`relbias.attention`'s, keys at positions 0 .. Lk-1.
        hf_mask: transformers' 4D mask, (B, 1, Lq, Lk), or None.
        bias: the layer's offset-only :class:`relbias.RelativeBias` (read in the graph at the call's offsets).
        is_causal, query_start, scale, convention: as :func:`relbias.attention`'s; backend: a name, or None for
            ``"auto"``; dropout_p: the layer's attention dropout (0 outside training; its seed drawn here, in the
            graph, from torch's global generator as an eager call draws it); enable_gqa: whether ``key``
            has fewer heads than ``query``; key_bias: for a model that counts positions over visible tokens,
            ``visible (B, Lk) -> (B, H, 1, Lk)``, its own per-key bias (:func:`hf_masked_attention`).

    Returns:
        None, for the caller's own path, outside ``torch.compile``, without a 4D tensor mask of one head, with a
        tensor ``query_start`` (a compiled static cache's decoding step), or for the ``structured`` backend; else
        (B, H, Lq, Dv).
    """
    if (not torch.compiler.is_compiling() or not isinstance(hf_mask, torch.Tensor) or hf_mask.dim() != 4
            or hf_mask.shape[1] != 1 or type(query_start) is not int or backend in _NOT_TAKEN):
        return None
    alignment = resolve_alignment(query.shape[2], key.shape[2], query_start=query_start)
    values = bias.offset_values(alignment.offset_vector(query.device))
    per_key = None if key_bias is None else key_bias(hf_visible(hf_mask)[:, 0, -1, :])  # the last query's keys
    # drawn as relbias.attention draws it under compile (the global generator's next number; none without dropout)
    dropout = _dropout(dropout_p, None, torch.device("cpu"))
    seed = torch.zeros((), dtype=torch.int64) if dropout is None else dropout.seed
    return hf_masked_attention(query, key, value, hf_mask, values, per_key, query_start, is_causal,
                               bias.bidirectional, scale, convention, backend or "auto", enable_gqa, float(dropout_p),
                               seed)
