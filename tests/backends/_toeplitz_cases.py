"""Shared by the toeplitz tests: a bias of each offset-only family with its parameters perturbed (float64), and one
attention call's outputs and gradients under a loss that also reads the lse."""

from __future__ import annotations

import torch

import relbias
from relbias.biases import make_bias

H = 3


def family_bias(name, *, bidirectional, num_heads=H):
    if name == "function":  # a learnable function of the offset that no family implements
        weight = torch.nn.Parameter(torch.randn(num_heads, 1, dtype=torch.float64))
        return relbias.FunctionBias(lambda o: torch.sin(weight * o.double() / 3) * weight, num_heads=num_heads,
                                    bidirectional=bidirectional), [weight]
    options = {"out_of_range": "clip"} if name == "offset_clip" else {}
    bias = make_bias(name.replace("_clip", ""), num_heads=num_heads, max_len=60, bidirectional=bidirectional,
                     **options)
    bias = bias.double()
    with torch.no_grad():
        for p in bias.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return bias, list(bias.parameters())


def run_with_grads(backend, q, k, v, bias, params, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for p in params:
        p.grad = None
    out, lse = relbias.attention(q, k, v, bias=bias, backend=backend, return_lse=True, **kwargs)
    weights = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)
    loss = (out * weights).sum() + 0.3 * torch.where(torch.isinf(lse), 0.0, lse).sum()
    loss.backward()
    grads = [q.grad, k.grad, v.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return [out.detach(), lse.detach()] + grads
