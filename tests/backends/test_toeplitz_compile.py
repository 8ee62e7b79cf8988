"""The toeplitz backend under torch.compile(fullgraph=True): its forward and backward are custom ops, one graph node
each, so a compiled call has no graph break and equals eager, outputs and gradients (bias parameters included)."""

from __future__ import annotations

import pytest
import torch

import relbias


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_forward_and_backward_equal_eager_without_graph_breaks(is_causal=True):
    bias = relbias.PerOffsetBias(max_len=40, num_heads=2, bidirectional=not is_causal, out_of_range="clip")
    with torch.no_grad():
        bias.weight.normal_()
    q, k, v = (torch.randn(2, 2, 24, 8, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, is_causal=is_causal, backend="toeplitz")

    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(f, fullgraph=True), f):
        for t in (q, k, v, bias.weight):
            t.grad = None
        out = fn(q, k, v)
        (out * torch.linspace(-1, 1, 8)).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad, bias.weight.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [(-1, -1), (2, -1)])  # (left, right) sides, -1 unbounded
@pytest.mark.parametrize("values_grad", [True, False])
def test_the_custom_ops_pass_torch_library_opcheck(values_grad, window):
    """Schema, fake (meta) kernels against the real ones (shapes, strides, dtypes), and the autograd registration."""
    from relbias.backends.toeplitz._kernel import toeplitz_backward, toeplitz_forward

    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (5, 7, 7))
    values = torch.randn(7 + 5 - 1, 2, dtype=torch.float64).t().requires_grad_(values_grad)  # strided, like a lookup
    # scale, bias_scale, delta, is_causal, block_q, tile, no dropout, the window's sides
    settings = (0.5, 1.0, 2, True, 3, 4, 0.0, 0, 0, 0, *window)
    torch.library.opcheck(toeplitz_forward, (q, k, v, values, None, *settings))
    out, lse = toeplitz_forward(q, k, v, values.detach(), None, *settings)
    grads = (torch.randn_like(out), torch.randn_like(lse))
    torch.library.opcheck(toeplitz_backward, (*grads, q, k, v, values.detach(), None, out, lse, *settings, values_grad))
