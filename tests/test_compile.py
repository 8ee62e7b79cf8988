"""torch.compile (issue 11, item 4, in part): relbias.attention and relbias.nn.MultiheadAttention compile with
fullgraph=True on the reference, blockwise and decode paths (inference), equal eager, with no graph break, and a
length change alone does not recompile without bound."""

from __future__ import annotations

import pytest
import torch

import relbias

from ._tolerance import assert_rounding_close

PATHS = [("reference", 12), ("blockwise", 12), ("decode", 3)]  # (backend, query length)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("backend, lq", PATHS)
def test_attention_compiles_whole_and_equals_eager(backend, lq):
    bias = relbias.T5Bias(2, bidirectional=False, init_std=1.0)
    q, k = torch.randn(2, 2, lq, 8), torch.randn(2, 2, 12, 8)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., :2] = False

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, mask=mask, is_causal=True, backend=backend)

    with torch.no_grad():
        explained = torch._dynamo.explain(f)(q, k, k)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, k), f(q, k, k), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend, lq", PATHS)
def test_multihead_attention_compiles_whole_and_equals_eager(backend, lq):
    bias = relbias.T5Bias(2, bidirectional=False, init_std=1.0)
    layer = relbias.nn.MultiheadAttention(16, 2, batch_first=True, position_bias=bias, is_causal=True, backend=backend)
    x = torch.randn(2, lq, 16)

    def f(x):
        return layer(x, x, x, need_weights=False)[0]

    with torch.no_grad():
        assert torch._dynamo.explain(f)(x).graph_break_count == 0
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x), rtol=1e-5, atol=1e-6)


def test_a_length_change_alone_does_not_recompile_without_bound():
    bias = relbias.ALiBiBias(2)
    compiled = torch.compile(lambda q, k: relbias.attention(q, k, k, bias=bias, is_causal=True, backend="decode"))
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for n in range(20, 30):  # ten cache lengths, one query each
            q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, n, 8)
            torch.testing.assert_close(compiled(q, k), relbias.attention(q, k, k, bias=bias, is_causal=True))
    assert counters["stats"]["unique_graphs"] - before <= 2  # one static graph, then one with dynamic lengths


@pytest.mark.parametrize(
    "backend, is_causal, mask_kind",
    [("reference", True, "bool"), ("decode", True, "float"), ("decode", False, "bool"), ("auto", True, None)],
)
def test_a_tensor_query_position_compiles_once_for_every_position(backend, is_causal, mask_kind):
    """A decoding step with a static cache: the query position arrives as a 0-dim tensor and stays one, so one
    graph (no recompilation, no data-dependent guard) serves every position, equal to eager with int positions."""
    bias = relbias.T5Bias(2, bidirectional=False, init_std=1.0)
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 12, 8)

    def f(q, k, query_start, mask):
        return relbias.attention(q, k, k, bias=bias, mask=mask, is_causal=is_causal, query_start=query_start,
                                 backend=backend)

    compiled = torch.compile(f, fullgraph=True)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for position in (3, 7, 11):
            filled = torch.arange(12) <= position  # a static cache's filled slots (keys after the query hidden)
            mask = None if mask_kind is None else filled.expand(2, 1, 1, 12).clone()
            if mask is not None:
                mask[1, ..., :2] = False  # a padded row
                if mask_kind == "float":
                    mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
            want = f(q, k, position, mask)
            torch.testing.assert_close(compiled(q, k, torch.tensor(position), mask), want, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_backends_that_plan_from_int_positions_refuse_tensor_positions_while_compiling():
    """blockwise, structured and toeplitz plan tiles or kernel calls in Python from int positions; with tensor
    positions (a compiled static cache) they refuse with the reason, and auto runs the reference instead."""
    bias = relbias.T5Bias(2, bidirectional=False)
    q, k = torch.randn(1, 2, 1100, 8), torch.randn(1, 2, 4000, 8)
    seen = {}

    def f(q, k, v, position):
        for name in ("blockwise", "structured", "toeplitz"):
            seen[name] = relbias.backends.BACKENDS[name].unsupported_reasons(
                relbias.call.make_call(q, k, v, bias=bias, is_causal=True, query_start=position)
            )
        return relbias.attention(q, k, v, bias=bias, is_causal=True, query_start=position)

    with torch.no_grad():
        got = torch.compile(f, fullgraph=True)(q, k, k, torch.tensor(2900))
        want = relbias.attention(q, k, k, bias=bias, is_causal=True, query_start=2900, backend="reference")
    # inductor's generated code against eager ATen kernels: other summation orders over up to 4000 keys
    assert_rounding_close(got, want, n=4000)
    for name, reasons in seen.items():
        assert any("the positions are tensors" in reason for reason in reasons), (name, reasons)
