"""The toeplitz backend under torch.compile(fullgraph=True): its forward and backward are custom ops, one graph node
each, so a compiled call has no graph break and equals eager, outputs and gradients (bias parameters included)."""

from __future__ import annotations

import pytest
import torch

import relbias


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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


@pytest.mark.parametrize(("values_grad", "window", "padded", "dropout_p"), [
    (True, (-1, -1), False, 0.0), (False, (-1, -1), False, 0.0), (True, (2, -1), False, 0.0),
    (False, (2, -1), False, 0.0), (True, (-1, -1), True, 0.0), (True, (-1, -1), False, 0.3), (True, (2, -1), True, 0.3),
])  # window: (left, right) sides, -1 unbounded; padded: a key padding row hiding the last keys and, on one head, all
def test_the_custom_ops_pass_torch_library_opcheck(values_grad, window, padded, dropout_p):
    """Schema, fake (meta) kernels against the real ones (shapes, strides, dtypes), and the autograd registration,
    with and without a key padding mask and attention dropout."""
    from relbias.backends.toeplitz._kernel import toeplitz_backward, toeplitz_forward

    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (5, 7, 7))
    values = torch.randn(7 + 5 - 1, 2, dtype=torch.float64).t().requires_grad_(values_grad)  # strided, like a lookup
    padding = None
    if padded:  # additive (Bm, Hm, Lk) rows, 0 or -inf
        padding = torch.zeros(1, 2, 7, dtype=torch.float64)
        padding[:, 0, 5:] = float("-inf")
        padding[:, 1, :] = float("-inf")
    # scale, bias_scale, delta, is_causal, block_q, tile, dropout_p, seed, query_start, key_start, the window's sides
    settings = (0.5, 1.0, 2, True, 3, 4, dropout_p, torch.tensor(7), 0, 0, *window)
    torch.library.opcheck(toeplitz_forward, (q, k, v, values, padding, *settings))
    out, lse = toeplitz_forward(q, k, v, values.detach(), padding, *settings)
    grads = (torch.randn_like(out), torch.randn_like(lse))
    torch.library.opcheck(toeplitz_backward,
                          (*grads, q, k, v, values.detach(), padding, out, lse, *settings, values_grad))
