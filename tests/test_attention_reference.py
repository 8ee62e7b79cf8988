"""The reference path: conventions, masks, alignment, gradients and the seeds' properties."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relbias
from relbias import FunctionBias, PerOffsetBias, T5Bias

from ._tolerance import assert_rounding_close


def qkv(b=2, h=3, lq=5, lk=7, d=4, dv=6, dtype=torch.float32):
    return (
        torch.randn(b, h, lq, d, dtype=dtype),
        torch.randn(b, h, lk, d, dtype=dtype),
        torch.randn(b, h, lk, dv, dtype=dtype),
    )


# --- each score convention pinned by a hand-computed case -----------------------------------

Q = torch.tensor([1.0, 0.0, 2.0, 0.0]).view(1, 1, 1, 4)  # head_dim 4: default scale 1/2
K = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]).view(1, 1, 2, 4)  # q.k = 1, 2
V = torch.tensor([[10.0], [20.0]]).view(1, 1, 2, 1)
PE = torch.tensor([[[3.0, -1.0]]])  # (H, Lq, Lk)


def _expected(s0, s1):
    w0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    return 10 * w0 + 20 * (1 - w0)


@pytest.mark.parametrize(
    "convention, scale, scores",
    [
        ("seed", None, ((1 + 3) * 0.5, (2 - 1) * 0.5)),  # ((q.k) + PE) * scale
        ("additive", None, (1 * 0.5 + 3, 2 * 0.5 - 1)),  # (q.k) * scale + PE
        ("t5", None, (1 + 3, 2 - 1)),  # (q.k) + PE
        ("seed", 1.0, (1 + 3, 2 - 1)),  # explicit scale=1.0 is honoured
        ("additive", 0.25, (0.25 + 3, 0.5 - 1)),
    ],
)
def test_score_conventions_hand_computed(convention, scale, scores):
    out = relbias.attention(Q, K, V, bias=PE, convention=convention, scale=scale)
    assert out.item() == pytest.approx(_expected(*scores), rel=1e-6)


def test_t5_bias_defaults_to_unscaled_scores():
    bias = T5Bias(1)
    with torch.no_grad():
        bias.weight.zero_()
        bias.weight[1] = 3.0  # offset 1 (key 0 seen from query 1)
    q = Q.expand(1, 1, 1, 4)
    k, v = K, V  # query at position 1; key 0 has offset 1, key 1 offset 0
    out = relbias.attention(q, k, v, bias=bias)
    assert out.item() == pytest.approx(_expected(1 + 3, 2 + 0), rel=1e-6)


def test_t5_convention_rejects_a_scale():
    with pytest.raises(ValueError, match="unscaled"):
        relbias.attention(Q, K, V, bias=T5Bias(1), scale=0.5)


# --- agreement with PyTorch SDPA as an independent reference --------------------------------


@pytest.mark.parametrize("convention", ["seed", "additive", "t5"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa_with_the_bias_as_attn_mask(convention, is_causal):
    q, k, v = qkv(lq=6, lk=6)
    bias = T5Bias(3, num_buckets=8, max_distance=16, init_std=1.0, bidirectional=not is_causal)
    pe = bias(6, 6)
    scale = 1.0 if convention == "t5" else 0.5
    attn_mask = pe * scale if convention == "seed" else pe
    if is_causal:
        attn_mask = attn_mask.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    got = relbias.attention(q, k, v, bias=bias, is_causal=is_causal, convention=convention)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_tensor_bias_means_what_sdpa_attn_mask_means(is_causal):
    # no convention given: a tensor bias is added after scaling, as SDPA adds its float attn_mask (the seed
    # convention, which scales the bias too, differs by O(1) here: head_dim 4, scale 1/2, a unit-variance bias)
    q, k, v = qkv(lq=6, lk=6)
    table = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(0))
    got = relbias.attention(q, k, v, bias=table, is_causal=is_causal)
    attn_mask = table.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")) if is_causal else table
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    as_mask = relbias.attention(q, k, v, mask=table, is_causal=is_causal)
    assert_rounding_close(got, as_mask, n=6)
    seed = relbias.attention(q, k, v, bias=table, is_causal=is_causal, convention="seed")
    assert (seed - got).abs().max() > 0.05


# --- masks ------------------------------------------------------------------------------------


def test_masked_key_gets_exactly_zero_weight_despite_a_huge_bias():
    q, k, v = qkv(lq=4, lk=6)
    bias = torch.zeros(1, 1, 4, 6)
    bias[..., 2] = 1e30  # would dominate every row if it leaked through
    keep = torch.ones(6, dtype=torch.bool)
    keep[2] = False
    out = relbias.attention(q, k, v, bias=bias, mask=keep.view(1, 1, 1, 6))
    without = relbias.attention(q, k[:, :, keep], v[:, :, keep], bias=bias[..., keep])
    # 6 keys with one hidden and 5 keys are sums of other lengths (the terms sit in other vector lanes), so they
    # agree to rounding; a leaked 1e30 bias would make them differ entirely
    assert_rounding_close(out, without, n=6)


def test_float_mask_equals_bool_mask_and_adds_finite_values():
    q, k, v = qkv()
    keep = torch.rand(2, 1, 5, 7) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(2, 1, 5, 7).masked_fill(~keep, float("-inf"))
    a = relbias.attention(q, k, v, mask=keep)
    b = relbias.attention(q, k, v, mask=additive)
    # exact: both run the reference on the same scores, the float mask adding exact zeros where visible
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    extra = torch.randn(2, 1, 5, 7)
    c = relbias.attention(q, k, v, mask=additive + extra, convention="additive")
    d = relbias.attention(q, k, v, mask=keep, bias=extra, convention="additive")
    torch.testing.assert_close(c, d)


def test_rows_without_visible_keys_return_zeros_and_finite_gradients():
    q, k, v = (t.requires_grad_() for t in qkv(lq=3, lk=4))
    bias = T5Bias(3)
    keep = torch.ones(2, 1, 3, 4, dtype=torch.bool)
    keep[0, :, 1] = False  # batch 0, query 1 sees nothing
    out = relbias.attention(q, k, v, bias=bias, mask=keep)
    assert torch.equal(out[0, :, 1], torch.zeros(3, 6))
    out.square().sum().backward()
    for t in (q, k, v, bias.weight):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, :, 1], torch.zeros(3, 4))


def test_no_keys_at_all_returns_zeros():
    q, k, v = qkv(lk=0)
    assert torch.equal(relbias.attention(q, k, v), torch.zeros(2, 3, 5, 6))


# --- alignment --------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [T5Bias(3, bidirectional=False, init_std=1.0), PerOffsetBias(max_len=12, num_heads=3, bidirectional=False, init_std=1.0)])
def test_default_alignment_equals_the_last_rows_of_full_attention(bias):
    # decoding with a KV cache: the last queries against all keys
    q, k, v = qkv(lq=10, lk=10)
    full = relbias.attention(q, k, v, bias=bias, is_causal=True)
    tail = relbias.attention(q[:, :, -3:], k, v, bias=bias, is_causal=True)
    torch.testing.assert_close(tail, full[:, :, -3:], rtol=1e-6, atol=1e-6)
    explicit = relbias.attention(q[:, :, 4:6], k, v, bias=bias, is_causal=True, query_start=4)
    torch.testing.assert_close(explicit, full[:, :, 4:6], rtol=1e-6, atol=1e-6)


def test_bias_depends_only_on_i_minus_j():
    # shifting every position by the same amount changes nothing
    q, k, v = qkv()
    bias = T5Bias(3, init_std=1.0)
    a = relbias.attention(q, k, v, bias=bias, query_start=3, key_start=0)
    b = relbias.attention(q, k, v, bias=bias, query_start=503, key_start=500)
    assert torch.equal(a, b)
    c = relbias.attention(q, k, v, bias=bias, query_start=4, key_start=0)
    assert not torch.allclose(a, c)


def test_causality_later_tokens_do_not_change_earlier_outputs():
    q, k, v = qkv(lq=12, lk=12)
    bias = T5Bias(3, bidirectional=False, init_std=1.0)
    out = relbias.attention(q, k, v, bias=bias, is_causal=True)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:, :, 7:] = torch.randn_like(t[:, :, 7:])
    out2 = relbias.attention(q2, k2, v2, bias=bias, is_causal=True)
    assert torch.equal(out[:, :, :7], out2[:, :, :7])
    assert not torch.allclose(out[:, :, 7:], out2[:, :, 7:])


def test_without_pe_and_mask_attention_is_permutation_equivariant():
    # the seeds' "scrambled word order": no position information at all
    q, k, v = qkv(lq=8, lk=8)
    perm = torch.randperm(8)
    out = relbias.attention(q, k, v)
    scrambled = relbias.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    torch.testing.assert_close(scrambled, out[:, :, perm], rtol=1e-6, atol=1e-6)
    # a relative bias breaks it
    bias = T5Bias(3, init_std=1.0)
    out_pe = relbias.attention(q, k, v, bias=bias)
    scrambled_pe = relbias.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], bias=bias)
    assert not torch.allclose(scrambled_pe, out_pe[:, :, perm], atol=1e-4)


def test_adding_a_constant_to_a_row_of_pe_changes_nothing():
    q, k, v = qkv()
    pe = torch.randn(1, 3, 5, 7)
    row = torch.randn(1, 3, 5, 1)
    a = relbias.attention(q, k, v, bias=pe, convention="additive")
    b = relbias.attention(q, k, v, bias=pe + row, convention="additive")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- numerics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_t5_scores_beyond_fp16_range_stay_finite(dtype):
    # q.k ~ 1e5 would overflow float16 (max 65504) if the scores were kept in half precision
    q, k, v = qkv(lq=6, lk=6, d=64)
    q = q * 80
    k = k * 80
    bias = T5Bias(3, init_std=1.0)
    assert (q @ k.transpose(-1, -2)).abs().max() > 70000
    out = relbias.attention(q.to(dtype), k.to(dtype), v.to(dtype), bias=bias)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # only the inputs' rounding differs from the float32 run: compare against float32 on rounded inputs
    rounded = relbias.attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), bias=bias)
    torch.testing.assert_close(out.float(), rounded, rtol=0, atol=2 * torch.finfo(dtype).eps * v.abs().max().item())


# --- gradients --------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 3), nn.Tanh(), nn.Linear(3, 2)).double()

    def forward(self, offsets):
        return self.net(offsets.double().unsqueeze(-1)).movedim(-1, 0)  # (2, *S)


def _families():
    return [
        ("t5", T5Bias(2, num_buckets=8, max_distance=16, init_std=1.0).double(), False),
        ("t5-causal", T5Bias(2, num_buckets=8, max_distance=16, bidirectional=False, init_std=1.0).double(), True),
        ("offset", PerOffsetBias(max_len=6, num_heads=2, init_std=1.0).double(), False),
        ("offset-shared-causal", PerOffsetBias(max_len=6, bidirectional=False, init_std=1.0).double(), True),
        ("function", FunctionBias(_MLP(), num_heads=2), False),
    ]


@pytest.mark.parametrize("name, bias, is_causal", _families(), ids=[f[0] for f in _families()])
def test_float64_gradcheck_for_query_key_value_and_every_bias_parameter(name, bias, is_causal, bias_gradcheck):
    q, k, v = qkv(b=1, h=2, lq=4, lk=5, d=3, dv=2, dtype=torch.float64)
    names, _, _ = bias_gradcheck(bias, q, k, v, is_causal=is_causal, wrt_qkv=True)
    assert names


def test_nan_in_padded_keys_and_values_does_not_leak():
    q, k, v = (t.requires_grad_() for t in qkv(lq=3, lk=5))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 4], v2[:, :, 4] = float("nan"), float("inf")
    keep = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    keep[..., 4] = False
    bias = T5Bias(3, init_std=1.0)
    out = relbias.attention(q, k2, v2, mask=keep, bias=bias)
    clean = relbias.attention(q, k[:, :, :4], v[:, :, :4], bias=bias, query_start=2)
    torch.testing.assert_close(out, clean, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
