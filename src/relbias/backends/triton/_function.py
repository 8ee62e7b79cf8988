"""The Triton kernels' forward and backward as ``torch.library`` custom ops.

As custom ops with fake (meta) implementations, a compiled model (``torch.compile(fullgraph=True)``) calls each as one
node, forward and backward; their launches run inside it, reading no value on the host (safe to capture in a CUDA
graph). Eager calls run the same functions through a plain ``autograd.Function``, and inference calls the forward
alone. The settings travel as the ops' scalars, in :func:`settings` order (a :class:`._plan.Plan` without its
tensors); the packed boundaries and seeds as tensor arguments.
"""

from __future__ import annotations

import torch

from .._shared.autograd import eager_function, first_order
from ._backward import backward_dkdv, backward_dq
from ._bias_grad import bias_grad
from ._forward import forward
from ._plan import Plan

__all__ = ["settings", "triton_apply", "triton_backward", "triton_forward"]


def _plan(cu_seqlens, seeds, scale, bias_scale, lo, hi, delta, query_pos, key_pos, dropout_p, batch_seed, max_len,
          block) -> Plan:
    return Plan(scale=scale, bias_scale=bias_scale, band=(lo, hi), delta=delta, query_pos=query_pos, key_pos=key_pos,
                dropout_p=dropout_p, seeds=seeds, batch_seed=batch_seed, cu_seqlens=cu_seqlens, max_len=max_len,
                block=block)


def settings(plan: Plan) -> tuple:
    """``plan``'s scalars in the ops' order: scale, bias_scale, the band's lo and hi, delta, query_pos, key_pos,
    dropout_p, batch_seed, max_len, block."""
    lo, hi = plan.band
    return (plan.scale, plan.bias_scale, lo, hi, plan.delta, plan.query_pos, plan.key_pos, plan.dropout_p,
            plan.batch_seed, plan.max_len, plan.block)


def _forward_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor, padding: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, seeds: torch.Tensor | None, scale: float, bias_scale: float, lo: int | None,
    hi: int | None, delta: int, query_pos: int, key_pos: int, dropout_p: float, batch_seed: int, max_len: int,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, Dv) contiguous in the dtype of ``query``, lse (B, H, Lq) float32) of
    :func:`._forward.forward`; ``values`` (Hb, M), any float dtype (read as float32)."""
    plan = _plan(cu_seqlens, seeds, scale, bias_scale, lo, hi, delta, query_pos, key_pos, dropout_p, batch_seed,
                 max_len, block)
    return forward(_dense(query), _dense(key), _dense(value), values.detach().float().contiguous(), padding, plan)


triton_forward = torch.library.custom_op("relbias::triton_forward", _forward_impl, mutates_args=())


@triton_forward.register_fake
def _(query, key, value, values, padding, cu_seqlens, seeds, *settings):
    b, h, lq, _ = query.shape
    return query.new_empty(b, h, lq, value.shape[-1]), query.new_empty(b, h, lq, dtype=torch.float32)


def _backward_impl(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, values: torch.Tensor, padding: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    seeds: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, scale: float, bias_scale: float,
    lo: int | None, hi: int | None, delta: int, query_pos: int, key_pos: int, dropout_p: float, batch_seed: int,
    max_len: int, block: int, query_grad: bool, key_value_grad: bool, values_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dvalues), each empty where its flag asks for none: dq, dk, dv with the strides of the dense
    inputs the forward read, dvalues (Hb, M) in the dtype of ``values``."""
    plan = _plan(cu_seqlens, seeds, scale, bias_scale, lo, hi, delta, query_pos, key_pos, dropout_p, batch_seed,
                 max_len, block)
    query, key, value = _dense(query), _dense(key), _dense(value)
    w = values.float().contiguous()
    empty = lse == float("-inf")
    grad_out = grad_out.to(out.dtype).contiguous()
    di = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        di = di - grad_lse.float().masked_fill(empty, 0.0)
    lse = lse.masked_fill(empty, float("inf"))  # P = exp(s - inf) = 0 for a query that saw no key
    args = (query, key, value, grad_out, lse, di, w, padding, plan)
    dq = backward_dq(*args) if query_grad else query.new_empty(0)
    dk, dv = backward_dkdv(*args) if key_value_grad else (key.new_empty(0), value.new_empty(0))
    dvalues = bias_grad(*args).to(values.dtype) if values_grad else values.new_empty(0)
    return dq, dk, dv, dvalues


triton_backward = torch.library.custom_op("relbias::triton_backward", _backward_impl, mutates_args=())


@triton_backward.register_fake
def _(grad_out, grad_lse, query, key, value, values, padding, cu_seqlens, seeds, out, lse, *rest):
    query_grad, key_value_grad, values_grad = rest[-3:]
    dq = torch.empty_like(_dense(query)) if query_grad else query.new_empty(0)
    dk = torch.empty_like(_dense(key)) if key_value_grad else key.new_empty(0)
    dv = torch.empty_like(_dense(value)) if key_value_grad else value.new_empty(0)
    return dq, dk, dv, values.new_empty(values.shape) if values_grad else values.new_empty(0)


def _setup_context(ctx, inputs, output):
    query, key, value, values, padding, cu_seqlens, seeds, *scalars = inputs
    ctx.settings = scalars
    ctx.save_for_backward(query, key, value, values.detach(), padding, cu_seqlens, seeds, *output)
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient


def _backward_with(backward_op):
    @first_order("triton")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, values, padding, cu_seqlens, seeds, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dvalues = backward_op(grad_out, grad_lse, query, key, value, values, padding, cu_seqlens, seeds,
                                          out, lse, *ctx.settings, needs[0], needs[1] or needs[2], needs[3])
        grads = (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                 dvalues if needs[3] else None)
        return *grads, None, None, None, *([None] * len(ctx.settings))

    return backward


triton_forward.register_autograd(_backward_with(triton_backward), setup_context=_setup_context)

_Eager = eager_function("TritonEager", _forward_impl, _setup_context, _backward_with(_backward_impl))


def triton_apply(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor,
                 padding: torch.Tensor | None, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the Triton kernels, differentiable in query, key, value and the per-offset ``values``
    (Hb, M); ``padding`` None or uint8 (Bm, Hm, Lk), nonzero where a key is kept. As the custom ops while
    torch.compile traces, else as plain functions (the forward alone where nothing needs a gradient)."""
    args = (query, key, value, values, padding, plan.cu_seqlens, plan.seeds, *settings(plan))
    if torch.compiler.is_compiling():
        return triton_forward(*args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, values)):
        return _Eager.apply(*args)
    return _forward_impl(*args)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where the kernels can read it and its gradient can share its strides (unit stride along the last
    dimension, dense: e.g. a (B, L, H, D) projection viewed as (B, H, L, D)); else a contiguous copy."""
    if tensor.stride(-1) == 1:
        expected = 1  # a dense layout: each stride, smallest first, is the product of the sizes below it
        for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
            if size != 1 and stride != expected:
                return tensor.contiguous()
            expected *= size
        return tensor
    return tensor.contiguous()
