"""The structured backend under torch.compile(fullgraph=True): forward and backward are custom ops, one graph node
each, so a compiled call with a T5 bias and a key padding mask has no graph break and equals eager (outputs and
every gradient, the bias table's included)."""

from __future__ import annotations

import pytest
import torch

import relbias


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("is_causal", [False, True])
def test_compiled_forward_and_backward_equal_eager_without_graph_breaks(is_causal):
    torch.manual_seed(0)
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16, bidirectional=not is_causal)
    q, k, v = (torch.randn(2, 2, 48, 8, requires_grad=True) for _ in range(3))
    padding = torch.ones(2, 1, 1, 48, dtype=torch.bool)
    padding[1, ..., 40:] = False  # a padded batch row: toeplitz takes no mask, structured does

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, mask=padding, is_causal=is_causal, backend="structured")

    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f, _reference(bias, padding, is_causal)):
        for t in (q, k, v, bias.weight):
            t.grad = None
        out = fn(q, k, v)
        (out * torch.linspace(-1, 1, 8)).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad, bias.weight.grad])
    for got, eager, want in zip(*results):
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(eager, want, rtol=1e-4, atol=1e-5)


def _reference(bias, padding, is_causal):
    return lambda q, k, v: relbias.attention(q, k, v, bias=bias, mask=padding, is_causal=is_causal, backend="reference")


@pytest.mark.parametrize("values_grad", [True, False])
def test_the_custom_ops_pass_torch_library_opcheck(values_grad):
    """Schema, fake (meta) kernels against the real ones (shapes, strides, dtypes), and the autograd registration."""
    from relbias.backends.structured._kernel import structured_backward, structured_forward

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (30, 30, 30))
    values = torch.randn(2, 59, dtype=torch.float64).requires_grad_(values_grad)
    keep = torch.ones(1, 1, 30, dtype=torch.bool)
    keep[..., 25:] = False
    settings = (0.5, 1.0, 0, 0, False, 6, 8)  # scale, bias_scale, query_start, key_start, is_causal, T, block_q
    torch.library.opcheck(structured_forward, (q, k, v, values, keep, *settings, values_grad))
    out, lse, parts_out, parts_lse = structured_forward(q, k, v, values.detach(), keep, *settings, values_grad)
    assert parts_out.shape[2] == (parts_lse.shape[2] if values_grad else 0)
    grads = (torch.randn_like(out), torch.randn_like(lse))
    torch.library.opcheck(
        structured_backward, (*grads, q, k, v, values.detach(), keep, out, lse, parts_out, parts_lse, *settings,
                              values_grad),
    )
