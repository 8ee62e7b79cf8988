"""The triton backend's dropout and packed sequences under the Triton interpreter: the kernels' dropout bits equal
relbias._dropout's mask bit for bit; with one seed the output and gradients equal the reference's and the native
toeplitz kernels' (the same entries dropped); packed sequences, empty ones included, equal running them one by one,
dropout included (each sequence's seed drawn in the same order)."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias._dropout import Dropout
from relbias.backends.toeplitz import _native as toeplitz_native

from ._triton_cases import require_interpreter, run
from .._tolerance import assert_rounding_close

require_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from relbias.backends.triton._tiles import keep_mask  # noqa: E402

H, D = 2, 8


@triton.jit
def _keep_bits(OUT, seed, batch, query_start, key_start, threshold, M: tl.constexpr, N: tl.constexpr):
    head = tl.program_id(0)
    keep = keep_mask(tl.load(seed), batch, head, query_start + tl.arange(0, M), key_start + tl.arange(0, N), threshold)
    cells = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(OUT + head * M * N + cells, keep.to(tl.int8))


@pytest.mark.parametrize("p, seed, batch, query_start, key_start", [(0.2, 11, 0, 0, 0), (0.5, 2**31 - 2, 3, 70000, 5),
                                                                    (0.9, 12345, 1, 2**30, 2**31 - 40)])
def test_the_kernels_dropout_bits_are_relbias_mask(p, seed, batch, query_start, key_start):
    heads, m, n = 3, 16, 32
    got = torch.empty(heads, m, n, dtype=torch.int8)
    _keep_bits[(heads,)](got, torch.tensor([seed], dtype=torch.int32), batch, query_start, key_start,
                         int(p * 2**32), M=m, N=n)
    want = Dropout(p, seed, query_start, key_start).scale_tile(batch + 1, heads, 0, m, 0, n, "cpu", torch.float32)
    assert torch.equal(got.bool(), want[batch] != 0)
    assert abs(got.float().mean().item() - (1 - p)) < 0.1  # and it keeps about 1 - p of the entries


def _inputs(lq, lk, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, H, lq, D, generator=gen), torch.randn(batch, H, lk, D, generator=gen),
            torch.randn(batch, H, lk, D, generator=gen))


def _t5(causal):
    bias = relbias.T5Bias(H, bidirectional=not causal)
    with torch.no_grad():
        bias.weight.normal_(generator=torch.Generator().manual_seed(3))
    return bias


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_drops_the_entries_the_reference_and_the_cpu_kernels_drop(causal):
    q, k, v = _inputs(33, 40)
    bias = _t5(causal)
    keep = torch.rand(2, 1, 1, 40, generator=torch.Generator().manual_seed(4)) > 0.2
    kwargs = dict(is_causal=causal, mask=keep, dropout_p=0.3, query_start=20, key_start=5)
    got = run("triton", q, k, v, bias, **kwargs)
    backends = ["reference"] + (["toeplitz"] if toeplitz_native.native_unavailable_reason() is None else [])
    for backend in backends:
        for a, b in zip(got, run(backend, q, k, v, bias, **kwargs)):
            assert_rounding_close(a.masked_fill(torch.isinf(a), 0), b.masked_fill(torch.isinf(b), 0), n=40)
    other_seed = run("triton", q, k, v, bias, seed=6, **kwargs)
    assert not torch.allclose(got[0], other_seed[0])  # another seed drops other entries


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_packed_sequences_equal_running_them_one_by_one(causal, dropout_p):
    bounds = [0, 5, 5, 30, 47]  # an empty sequence; the longest spans two 16-row tiles
    q, k, v = _inputs(47, 47, batch=1)
    bias = _t5(causal)
    got = run("triton", q, k, v, bias, function=relbias.attention_varlen, args=(bounds,), is_causal=causal,
              dropout_p=dropout_p)
    want = run("reference", q, k, v, bias, function=relbias.attention_varlen, args=(bounds,), is_causal=causal,
               dropout_p=dropout_p)
    for a, b in zip(got, want):
        assert_rounding_close(a, b, n=47)


def test_packed_sequences_the_kernels_cannot_run_are_refused_by_name_and_run_one_by_one_by_auto():
    q, k, v = _inputs(20, 20, batch=1)
    with pytest.raises(ValueError, match="backend 'triton' cannot run these packed sequences: there is no bias"):
        relbias.attention_varlen(q, k, v, [0, 8, 20], backend="triton")
    fire = relbias.FIREBias(H)
    with pytest.raises(ValueError, match="FIREBias reads absolute positions"):
        relbias.attention_varlen(q, k, v, [0, 8, 20], bias=fire, backend="triton")
    out = relbias.attention_varlen(q, k, v, [0, 8, 20], bias=fire)  # auto on CPU: one call per sequence
    assert_rounding_close(out[:, :, 8:], relbias.attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], bias=fire), n=12)
