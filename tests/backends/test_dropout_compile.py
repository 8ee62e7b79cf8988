"""Attention dropout under torch.compile: the call's seed is drawn in the graph as a tensor that the kernels read
where they run, so a compiled call with dropout has no graph break of its own, and with the random numbers eager code
draws (aot_eager, or inductor with ``fallback_random``) it equals eager, output and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

import relbias
from relbias.backends.toeplitz import _native as _toeplitz_native

from .._tolerance import assert_rounding_close

H, D = 2, 8


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _results(fn, bias, tensors, seed):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    bias.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the call draws its mask seed from torch's global generator
    out = fn(*tensors)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), *(t.grad for t in tensors), bias.weight.grad]


def _inputs(lq=20, lk=20):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, H, n, D, generator=gen) for n in (lq, lk, lk)]


BACKENDS = [
    pytest.param("toeplitz", marks=pytest.mark.skipif(_toeplitz_native.native_unavailable_reason() is not None,
                                                      reason="dropout on toeplitz runs in its native kernels")),
    "blockwise", "reference",
]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_call_with_dropout_equals_eager_without_graph_breaks(backend, padded, compiler):
    bias = relbias.T5Bias(H, bidirectional=False)
    with torch.no_grad():
        bias.weight.normal_(generator=torch.Generator().manual_seed(3))
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
        mask[0, ..., 15:] = False

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, mask=mask, is_causal=True, dropout_p=0.3, backend=backend)

    tensors = _inputs()
    if backend != "blockwise":  # its autograd.Function ends the graph with or without dropout (its backward state)
        explained = torch._dynamo.explain(f)(*tensors)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
    want = _results(f, bias, tensors, seed=7)
    undropped = relbias.attention(*tensors, bias=bias, mask=mask, is_causal=True, backend=backend)
    assert not torch.allclose(want[0], undropped, atol=1e-3)  # the mask dropped something
    with inductor_config.patch(fallback_random=True):  # inductor draws eager's random numbers
        got = _results(torch.compile(f, fullgraph=backend != "blockwise", backend=compiler), bias, tensors, seed=7)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], got, want):
        assert_rounding_close(a, b, n=20, msg=lambda m, name=name: f"{name}: {m}")


def test_each_compiled_call_draws_a_new_seed():
    """Two calls of one compiled function drop different entries (the seed is drawn per call in the graph, not
    fixed when traced), and two runs from one global seed drop the same ones."""
    bias = relbias.T5Bias(H, bidirectional=False)
    q, k, v = _inputs()
    f = torch.compile(lambda q, k, v: relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.5,
                                                        backend="blockwise"), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.manual_seed(1)
        first, second = f(q, k, v), f(q, k, v)
        torch.manual_seed(1)
        again = f(q, k, v)
    assert not torch.equal(first, second) and torch.equal(first, again)


def test_a_compiled_call_with_symbolic_shapes_equals_eager():
    """dynamic=True: the lengths and the head count are symbols in the graph (the bias's num_heads is compared with
    one), and the seed drawn in it; two lengths, one graph each way, equal to eager from the same global seed."""
    bias = relbias.T5Bias(3, bidirectional=False)
    f = lambda q, k, v: relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.3)  # noqa: E731
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for length in (5, 9):
        q, k, v = (torch.randn(2, 3, length, D) for _ in range(3))
        with torch.no_grad():
            torch.manual_seed(3)
            want = f(q, k, v)
            torch.manual_seed(3)
            assert_rounding_close(compiled(q, k, v), want, n=length)
