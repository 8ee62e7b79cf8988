"""Shared helpers of the triton backend's tests (not a test module): the skip when the kernels cannot run
interpreted here, and one differentiable call whose results the tests compare."""

from __future__ import annotations

import pytest
import torch

import relbias

from .._tolerance import rounding_tolerance


def require_interpreter():
    """Skip the module unless triton is installed and the kernels load under the Triton interpreter (tests/conftest.py
    sets TRITON_INTERPRET=1 before anything loads them)."""
    pytest.importorskip("triton")
    from relbias.backends.triton._support import interpreted

    if not interpreted():
        pytest.skip("the Triton kernels were loaded without TRITON_INTERPRET=1, so they need a GPU",
                    allow_module_level=True)


def run(backend, query, key, value, bias, *, function=relbias.attention, args=(), seed=5, **kwargs):
    """[out, lse, dq, dk, dv, d(each bias parameter)] of one call with ``backend``, on fresh leaf copies of the
    inputs, for the loss ``sum(out * g) + sum(lse * g')`` (fixed g, g'; -inf lse entries left out)."""
    query, key, value = (t.detach().clone().requires_grad_() for t in (query, key, value))
    bias.zero_grad(set_to_none=True)
    out, lse = function(query, key, value, *args, bias=bias, backend=backend, return_lse=True,
                        generator=torch.Generator().manual_seed(seed), **kwargs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    g_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2))
    loss = (out * g).float().sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * g_lse).sum()
    loss.backward()
    grads = [p.grad.clone() for p in bias.parameters() if p.requires_grad]
    return [out.detach(), lse.detach(), query.grad, key.grad, value.grad, *grads]

def assert_agree(got, want, *, n, dtype=torch.float32):
    """out, lse (-inf in the same places), dq, dk, dv and the bias table's gradient within the rounding of ``dtype``
    over ``n`` terms; returns the largest error of each."""
    errors = []
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"], got, want):
        if name == "lse":
            assert torch.equal(torch.isinf(a), torch.isinf(b)), "queries with no visible key differ"
            a, b = a.masked_fill(torch.isinf(a), 0.0), b.masked_fill(torch.isinf(b), 0.0)
        atol, rtol = rounding_tolerance(b.float(), n=n, dtype=dtype)
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")
        errors.append((a.float() - b.float()).abs().max().item())
    return errors
