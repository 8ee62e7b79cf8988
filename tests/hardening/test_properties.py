"""Property-based tests (hypothesis) over random shapes, positions and bias families (issue 7)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relbias
from relbias.biases import FAMILIES, make_bias

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _options(name):
    return {"out_of_range": "clip"} if name == "offset" else {}


@st.composite
def problems(draw):
    b = draw(st.integers(1, 2))
    h = draw(st.integers(1, 3))
    lq = draw(st.integers(1, 9))
    lk = draw(st.integers(1, 9))
    d = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk))
    return q, k, v


@SETTINGS
@given(
    qkv=problems(),
    name=st.sampled_from(sorted(FAMILIES)),
    is_causal=st.booleans(),
    key_start=st.integers(-50, 50),
    query_start=st.integers(-20, 60),
    shift=st.integers(-1000, 1000),
)
def test_offset_only_biases_depend_only_on_i_minus_j(qkv, name, is_causal, key_start, query_start, shift):
    q, k, v = qkv
    bias = make_bias(name, num_heads=q.shape[1], max_len=8, bidirectional=not is_causal, **_options(name))
    if bias is not None and not bias.offset_only:
        return  # e.g. FIRE reads the absolute query position by design
    kwargs = dict(bias=bias, is_causal=is_causal)
    a = relbias.attention(q, k, v, query_start=query_start, key_start=key_start, **kwargs)
    b = relbias.attention(q, k, v, query_start=query_start + shift, key_start=key_start + shift, **kwargs)
    assert torch.equal(a, b)


@SETTINGS
@given(qkv=problems(), convention=st.sampled_from(["seed", "additive", "t5"]), c=st.floats(-50, 50))
def test_adding_a_constant_to_a_whole_row_of_pe_changes_nothing(qkv, convention, c):
    q, k, v = qkv
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    pe = torch.randn(b, h, lq, lk)
    rows = torch.randn(b, h, lq, 1) * c
    a = relbias.attention(q, k, v, bias=pe, convention=convention)
    shifted = relbias.attention(q, k, v, bias=pe + rows, convention=convention)
    torch.testing.assert_close(a, shifted, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(qkv=problems(), name=st.sampled_from(sorted(FAMILIES)), is_causal=st.booleans())
def test_materialised_bias_equals_the_native_lookup(qkv, name, is_causal):
    q, k, _ = qkv
    lq, lk = q.shape[2], k.shape[2]
    bias = make_bias(name, num_heads=q.shape[1], max_len=8, bidirectional=not is_causal, **_options(name))
    if bias is None:
        return
    full = bias(lq, lk, query_start=3, key_start=1)
    positions = bias.pair_values(torch.arange(3, 3 + lq), torch.arange(1, 1 + lk))
    assert full.shape == (bias.num_heads, lq, lk)
    # the same formula on differently shaped tensors: vectorised and scalar CPU kernels may differ by an ulp
    torch.testing.assert_close(full, positions, rtol=1e-6, atol=1e-7)
