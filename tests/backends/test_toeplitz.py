"""The toeplitz backend against the reference in float64, where its own logic (reversed query blocks, the
strided bias view, causal key prefixes, the diagonal sums of the bias gradient) is the only difference: many
blocks and tiles of uneven sizes, every offset-only family, shared heads, positions, the lse and its gradient."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends import toeplitz

from ._toeplitz_cases import family_bias, run_with_grads

B, H, D = 2, 3, 8


CASES = [  # (Lq, Lk, query_start, key_start, is_causal)
    (45, 45, None, 0, True),
    (45, 45, None, 0, False),
    (17, 50, None, 0, True),  # a KV cache: queries on the last keys
    (50, 17, 0, 0, True),  # more queries than keys, top-left
    (30, 40, -12, 0, True),  # the first 12 queries see no key
    (30, 40, 25, 3, False),
]


@pytest.mark.parametrize("block_q, tile", [(7, 5), (16, 64), (512, 256)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-qs{c[2]}-ks{c[3]}-{'causal' if c[4] else 'bidi'}")
@pytest.mark.parametrize("family", ["alibi", "kerple_log", "kerple_power", "offset_clip", "t5", "function"])
def test_float64_outputs_lse_and_every_gradient_match_the_reference(family, case, block_q, tile, monkeypatch):
    monkeypatch.setattr(toeplitz, "BLOCK_Q", block_q)
    monkeypatch.setattr(toeplitz, "TILE", tile)
    lq, lk, query_start, key_start, is_causal = case
    torch.manual_seed(lq + lk)
    bias, params = family_bias(family, bidirectional=not is_causal or family == "function")
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (lq, lk, lk))
    kwargs = dict(is_causal=is_causal, query_start=query_start, key_start=key_start)
    assert relbias.explain_backend(q, k, v, bias=bias, backend="toeplitz", **kwargs)[0] == "toeplitz"
    got = run_with_grads("toeplitz", q, k, v, bias, params, **kwargs)
    want = run_with_grads("reference", q, k, v, bias, params, **kwargs)
    assert len(got) > 5 or family == "alibi"  # the bias gradient is compared (ALiBi has no parameter)
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv", "bias"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_one_bias_shared_by_every_head_broadcasts_and_gets_the_summed_gradient(monkeypatch):
    monkeypatch.setattr(toeplitz, "BLOCK_Q", 9)
    monkeypatch.setattr(toeplitz, "TILE", 6)
    bias, params = family_bias("function", bidirectional=True, num_heads=1)
    q, k, v = (torch.randn(B, H, 33, D, dtype=torch.float64) for _ in range(3))
    got, want = run_with_grads("toeplitz", q, k, v, bias, params), run_with_grads("reference", q, k, v, bias, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_float32_and_bfloat16_run_in_float32_and_return_the_input_dtype():
    bias, _ = family_bias("alibi", bidirectional=True)
    q, k, v = (torch.randn(1, H, 40, D) for _ in range(3))
    with torch.no_grad():
        want = relbias.attention(q.double(), k.double(), v.double(), bias=bias, backend="reference")
        got32 = relbias.attention(q, k, v, bias=bias, backend="toeplitz")
        got16 = relbias.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias, backend="toeplitz")
    assert got32.dtype == torch.float32 and got16.dtype == torch.bfloat16
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got16.double(), want, rtol=2e-2, atol=2e-2)


def test_an_offset_beyond_a_per_offset_table_is_an_error_not_a_guess():
    bias = relbias.PerOffsetBias(max_len=10, num_heads=H)
    q = torch.randn(1, H, 12, D)
    with pytest.raises(ValueError, match="offset 11 has no parameter"):
        relbias.attention(q, q, q, bias=bias, backend="toeplitz")


@pytest.mark.parametrize("backend", ["toeplitz", "structured", "blockwise"])
def test_double_backward_is_refused_not_silently_first_order(backend):
    bias = relbias.PerOffsetBias(max_len=8, num_heads=2, out_of_range="clip")
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    out = relbias.attention(q, k, v, bias=bias, backend=backend)
    with pytest.raises(RuntimeError, match=f"backend '{backend}' has no double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("layout", ["sliced", "transposed", "expanded"])
@pytest.mark.parametrize("backend", ["toeplitz", "structured", "decode"])
def test_keys_and_values_with_a_strided_last_dimension_match_the_reference(backend, layout):
    bias = relbias.PerOffsetBias(max_len=8, num_heads=2, out_of_range="clip")
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6 if backend != "decode" else 3, 4)
    if layout == "sliced":
        k = torch.randn(1, 2, 6, 8)[..., ::2]
    elif layout == "transposed":  # a key cache stored (B, H, D, L)
        k = torch.randn(1, 2, 4, 6).transpose(-1, -2)
    else:
        k = torch.randn(1, 2, 6, 1).expand(-1, -1, -1, 4)
    v = torch.randn(1, 2, 4, 6).transpose(-1, -2)
    with torch.no_grad():
        got = relbias.attention(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, bias=bias, backend=backend)
        want = relbias.attention(q, k.contiguous(), v.contiguous(), bias=bias, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["kerple_log", "alibi"])
def test_inputs_stored_batch_length_heads_dim_get_every_gradient_of_the_reference(family):
    """(B, L, H, D) tensors transposed to (B, H, L, D), as a projection's output usually is: the tiled backward
    (with bias parameters) and the kernel's backward (ALiBi, none) both gather their rows from strided inputs."""
    torch.manual_seed(1)
    bias, params = family_bias(family, bidirectional=True)
    q, k, v = (torch.randn(B, 40, H, D, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    got = run_with_grads("toeplitz", q, k, v, bias, params)
    want = run_with_grads("reference", q, k, v, bias, params)
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv", "bias"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
