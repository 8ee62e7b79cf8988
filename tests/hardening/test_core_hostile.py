"""Hostile and edge inputs on the functional entry point and the core bias families (issue 7).

Each case checks a documented error or a correct result, never a silent wrong answer.
"""

import itertools

import pytest
import torch

import relbias
from relbias import PerOffsetBias, T5Bias

from .._tolerance import assert_rounding_close


def _qkv(b=2, h=2, lq=4, lk=6, d=3, dtype=torch.float32):
    return torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, h, lk, d, dtype=dtype), torch.randn(b, h, lk, d, dtype=dtype)


def _naive(q, k, v, pe, keep, scale):
    """Per-row loop in float64: an implementation independent of the reference backend."""
    b, h, lq, _ = q.shape
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=torch.float64)
    for bi, hi, i in itertools.product(range(b), range(h), range(lq)):
        cols = keep[bi, hi, i].nonzero().flatten()
        if cols.numel() == 0:
            continue
        s = (q[bi, hi, i].double() @ k[bi, hi, cols].double().T + pe[hi, i, cols].double()) * scale
        out[bi, hi, i] = torch.softmax(s, -1) @ v[bi, hi, cols].double()
    return out


@pytest.mark.parametrize("lq, lk", [(1, 1), (1, 7), (7, 1), (3, 9), (9, 3), (0, 4), (4, 0), (0, 0)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("query_start", [None, 0, 5, -3])
@pytest.mark.filterwarnings(r"ignore:T5Bias\(bidirectional=True\) used with is_causal=True")  # deliberate here
def test_lengths_and_positions_against_a_naive_loop(lq, lk, is_causal, query_start):
    q, k, v = _qkv(lq=lq, lk=lk)
    bias = T5Bias(2, num_buckets=8, max_distance=16, init_std=1.0)
    out = relbias.attention(q, k, v, bias=bias, is_causal=is_causal, query_start=query_start, key_start=2)
    assert out.shape == (2, 2, lq, 3) and torch.isfinite(out).all()
    q0 = 2 + lk - lq if query_start is None else query_start
    offsets = torch.arange(q0, q0 + lq)[:, None] - torch.arange(2, 2 + lk)[None, :]
    keep = (offsets >= 0 if is_causal else torch.ones_like(offsets, dtype=torch.bool)).expand(2, 2, lq, lk)
    pe = bias.weight[relbias.t5_bucket(offsets, num_buckets=8, max_distance=16)].permute(2, 0, 1)
    torch.testing.assert_close(out.double(), _naive(q, k, v, pe, keep, 1.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape",
    [(6,), (4, 6), (1, 1, 4, 6), (2, 1, 1, 6), (2, 2, 4, 6), (1, 2, 1, 1), (2, 1, 4, 1)],
)
@pytest.mark.parametrize("dtype", [torch.bool, torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_masks_of_every_accepted_dtype_and_shape(shape, dtype):
    q, k, v = _qkv()
    keep = torch.rand(shape) > 0.4
    mask = keep if dtype == torch.bool else torch.zeros(shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    out = relbias.attention(q, k, v, mask=mask, scale=1.0)
    full_keep = keep.expand(2, 2, 4, 6)
    expected = _naive(q, k, v, torch.zeros(2, 4, 6), full_keep, 1.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~full_keep.any(-1)], torch.zeros_like(out[~full_keep.any(-1)]))  # empty rows: 0


def test_a_huge_positive_bias_on_a_masked_key_is_held_back():
    q, k, v = _qkv()
    for big in (1e4, 1e30, torch.finfo(torch.float32).max):
        bias = torch.zeros(1, 1, 1, 6)
        bias[..., 3] = big
        keep = torch.ones(1, 1, 1, 6, dtype=torch.bool)
        keep[..., 3] = False
        out = relbias.attention(q, k, v, bias=bias, mask=keep, convention="additive")
        ref = relbias.attention(q, k[:, :, [0, 1, 2, 4, 5]], v[:, :, [0, 1, 2, 4, 5]], query_start=2, convention="additive")
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_non_contiguous_and_expanded_tensors_equal_their_contiguous_copies():
    q, k, v = _qkv(lq=6, lk=6)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    kx = k[:1].expand(2, -1, -1, -1)  # expanded over batch (stride 0)
    vs = torch.randn(2, 2, 12, 3)[:, :, ::2]  # strided view
    bias = T5Bias(2, init_std=1.0, bidirectional=False)
    out = relbias.attention(qt, kx, vs, bias=bias, is_causal=True)
    ref = relbias.attention(q.contiguous(), kx.contiguous(), vs.contiguous(), bias=bias, is_causal=True)
    assert not qt.is_contiguous() and not vs.is_contiguous()
    # other strides are another layout for the kernels (other GEMM leading dimensions, other vector alignment):
    # equal to float32 rounding of the 6-key sums
    assert_rounding_close(out, ref, n=6)


def test_nan_and_inf_inputs_propagate_only_where_read():
    q, k, v = _qkv(lq=4, lk=4)
    q[0, 0, 1] = float("nan")
    out = relbias.attention(q, k, v, is_causal=True)
    assert torch.isnan(out[0, 0, 1]).all()
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, 0, 1] = False
    assert torch.isfinite(out[finite]).all()
    # a NaN value at key 3 reaches only queries that can see key 3 (causal: query 3)
    q, k, v = _qkv(lq=4, lk=4)
    v[:, :, 3] = float("nan")
    out = relbias.attention(q, k, v, is_causal=True)
    assert torch.isfinite(out[:, :, :3]).all() and torch.isnan(out[:, :, 3]).all()


@pytest.mark.parametrize("num_buckets", [0, 1, 3, 33])
def test_bad_bucket_counts(num_buckets):
    with pytest.raises(ValueError, match=f"num_buckets={num_buckets}"):
        T5Bias(2, num_buckets=num_buckets)


@pytest.mark.parametrize("max_distance, bidirectional", [(8, True), (4, True), (16, False), (1, False)])
def test_max_distance_not_larger_than_the_exact_region(max_distance, bidirectional):
    with pytest.raises(ValueError, match="larger than the exact region"):
        T5Bias(2, num_buckets=32, max_distance=max_distance, bidirectional=bidirectional)


def test_per_offset_beyond_the_table_in_attention_and_with_clipping():
    q, k, v = _qkv(lq=10, lk=10)
    with pytest.raises(ValueError, match="offset 9 has no parameter.*largest offset it knows is 7"):
        relbias.attention(q, k, v, bias=PerOffsetBias(max_len=8, bidirectional=False), is_causal=True)
    clipped = PerOffsetBias(max_len=8, bidirectional=False, out_of_range="clip", init_std=1.0)
    out = relbias.attention(q, k, v, bias=clipped, is_causal=True)
    # clipping equals a table extended with copies of the last trained entry
    longer = PerOffsetBias(max_len=10, bidirectional=False)
    with torch.no_grad():
        longer.weight[:8] = clipped.weight
        longer.weight[8:] = clipped.weight[7]
    # the same kernel on the same per-offset values (a clipped gather and the copies read the same rows): exact
    torch.testing.assert_close(out, relbias.attention(q, k, v, bias=longer, is_causal=True), rtol=0, atol=0)


def test_dtypes_that_differ_between_arguments():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        relbias.attention(q.half(), k, v)
    # a float64 bias with float32 inputs is computed in float32, result float32
    out = relbias.attention(q, k, v, bias=torch.zeros(4, 6, dtype=torch.float64))
    assert out.dtype == torch.float32
    # bias parameters in float32 with bfloat16 inputs (mixed precision) are fine
    out = relbias.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=T5Bias(2))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_gradients_are_finite_on_fully_masked_rows_for_every_core_family():
    for bias in (T5Bias(2), PerOffsetBias(max_len=6, num_heads=2, init_std=1.0), relbias.FunctionBias(lambda o: -o.abs().float())):
        q, k, v = (t.requires_grad_() for t in _qkv())
        keep = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
        keep[1, :, 2:] = True
        relbias.attention(q, k, v, bias=bias, mask=keep).sum().backward()
        for t in (q, k, v, *bias.parameters()):
            assert torch.isfinite(t.grad).all()
        assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))
