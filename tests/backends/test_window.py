"""Local (sliding-window) attention: ``window=(left, right)`` on every backend that runs it equals the reference with
the band given as a bool mask (float64: outputs, lse and every gradient, the bias table's included), composes with
the causal rule, positions, key padding, dropout and GQA, never evaluates the bias outside the band, and refuses bad
windows with a clear error."""

from __future__ import annotations

import itertools

import pytest
import torch

import relbias
from relbias.backends.toeplitz import _native
from .._window_band import band

NATIVE = _native.load_native() is not None
WINDOWS = [(3, None), (None, 2), (2, 1), (0, 0), (6, 6), (70, 9)]
BLOCKS = [(24, 24, None, 0), (5, 40, None, 0), (21, 33, 9, 2), (130, 150, 40, 11)]  # (Lq, Lk, query_start, key_start)


def make_bias(family, heads):
    bias = {
        "t5": lambda: relbias.T5Bias(heads, num_buckets=8, max_distance=16, init_std=1.0),
        "offset": lambda: relbias.PerOffsetBias(max_len=12, num_heads=heads, out_of_range="clip", init_std=1.0),
        "alibi": lambda: relbias.ALiBiBias(heads),
        "fire": lambda: relbias.FIREBias(heads),
    }[family]()
    return bias.double()


def run(backend, q, k, v, bias, grads=True, **kwargs):
    """Outputs, lse and the gradients of a loss that reads both (lse only where finite)."""
    q, k, v = (t.clone().requires_grad_(grads) for t in (q, k, v))
    params = list(bias.parameters()) if bias is not None else []
    for p in params:
        p.grad = None
    out, lse = relbias.attention(q, k, v, bias=bias, backend=backend, return_lse=True, **kwargs)
    if not grads:
        return [out, lse]
    (out.square().sum() + lse.masked_fill(torch.isinf(lse), 0.0).sum()).backward()
    return [out, lse, q.grad, k.grad, v.grad] + [p.grad for p in params if p.requires_grad]


def assert_same(got, want, atol=1e-9):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(torch.isneginf(g), torch.isneginf(w))
        torch.testing.assert_close(g.masked_fill(torch.isinf(g), 0), w.masked_fill(torch.isinf(w), 0), rtol=0,
                                   atol=atol)


def backends_for(family):
    names = ["reference", "blockwise"]
    if NATIVE and family != "fire":  # toeplitz reads offset-only biases; windows need its native kernels
        names.append("toeplitz")
    return names


@pytest.mark.filterwarnings("ignore:.*used with is_causal=True")  # one bidirectional bias serves both rules here
@pytest.mark.parametrize("family", ["t5", "offset", "alibi", "fire"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_every_backend_equals_the_reference_with_the_band_as_a_mask(family, is_causal):
    generator = torch.Generator().manual_seed(0)
    for (lq, lk, qs, ks), window in itertools.product(BLOCKS, WINDOWS):
        q = torch.randn(2, 2, lq, 8, dtype=torch.float64, generator=generator)
        k, v = (torch.randn(2, 2, lk, 8, dtype=torch.float64, generator=generator) for _ in range(2))
        bias = make_bias(family, 2)
        keep = band(lq, lk, qs, ks, window, is_causal)
        want = run("reference", q, k, v, bias, mask=keep[None, None], query_start=qs, key_start=ks)
        for backend in backends_for(family):
            got = run(backend, q, k, v, bias, window=window, is_causal=is_causal, query_start=qs, key_start=ks)
            assert_same(got, want)


@pytest.mark.filterwarnings("ignore:.*used with is_causal=True")
@pytest.mark.parametrize("is_causal", [False, True])
def test_a_window_composes_with_key_padding_and_gqa(is_causal):
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 30, 8, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(2, 2, 30, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    padding = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    padding[0, ..., :7] = False  # left padding: the first queries' windows hold only padding
    padding[1, ..., 25:] = False
    bias = make_bias("t5", 4)
    window = (4, 1)
    keep = band(30, 30, None, 0, window, is_causal)[None, None] & padding
    want = run("reference", q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), bias, mask=keep)
    assert bool(torch.isneginf(want[1]).any())  # some query sees no key: out 0, lse -inf
    for backend in ["reference", "blockwise"] + (["toeplitz"] if NATIVE else []):
        got = run(backend, q, k, v, bias, mask=padding, window=window, is_causal=is_causal, enable_gqa=True)
        want_kv = [w.view(2, 2, 2, 30, 8).sum(2) for w in want[3:5]]  # the repeated heads' gradients, summed
        assert_same(got, want[:3] + want_kv + want[5:])


@pytest.mark.skipif(not NATIVE, reason="the toeplitz kernels are not built here")
def test_dropout_inside_a_window_drops_the_entries_the_reference_drops():
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64, generator=generator) for _ in range(3))
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16, init_std=1.0, bidirectional=False).double()
    kwargs = dict(window=(5, 0), is_causal=True, dropout_p=0.3)
    want = run("reference", q, k, v, bias, generator=torch.Generator().manual_seed(7), **kwargs)
    for backend in ("blockwise", "toeplitz"):
        got = run(backend, q, k, v, bias, generator=torch.Generator().manual_seed(7), **kwargs)
        assert_same(got, want)


def test_decoding_reads_only_the_window_and_equals_the_full_windowed_forward():
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 50, 8, generator=generator) for _ in range(3))
    bias = relbias.T5Bias(2, bidirectional=False)
    window = (9, 0)
    with torch.no_grad():
        full = relbias.attention(q, k, v, bias=bias, is_causal=True, window=window, backend="reference")
        for t in (0, 5, 30, 49):
            step = relbias.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], bias=bias, is_causal=True,
                                     window=window)
            assert relbias.explain_backend(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], bias=bias,
                                           is_causal=True, window=window)[0] == "decode"
            torch.testing.assert_close(step, full[:, :, t:t + 1], rtol=1e-5, atol=1e-6)
        # keys outside every query's window are not read: NaN there changes nothing
        k_far, v_far = k.clone(), v.clone()
        k_far[:, :, :30], v_far[:, :, :30] = float("nan"), float("nan")
        step = relbias.attention(q[:, :, 45:47], k_far[:, :, :47], v_far[:, :, :47], bias=bias, is_causal=True,
                                 window=window, backend="decode")
        torch.testing.assert_close(step, full[:, :, 45:47], rtol=1e-5, atol=1e-6)


def test_a_window_inside_a_per_offset_table_never_asks_for_offsets_beyond_it():
    # max_len 8 with clipping off has no value for offsets >= 8; a causal window of 8 keys never reads one
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64, generator=generator) for _ in range(3))
    strict = relbias.PerOffsetBias(max_len=8, num_heads=2, bidirectional=False, init_std=1.0).double()
    clipped = relbias.PerOffsetBias(max_len=8, num_heads=2, bidirectional=False, out_of_range="clip").double()
    clipped.load_state_dict(strict.state_dict())
    with pytest.raises(ValueError, match="no parameter"):
        relbias.attention(q, k, v, bias=strict, is_causal=True)
    want = run("reference", q, k, v, clipped, is_causal=True, window=(7, 0))
    for backend in backends_for("offset"):
        assert_same(run(backend, q, k, v, strict, is_causal=True, window=(7, 0)), want)


def test_auto_runs_a_windowed_call_on_a_backend_that_skips_the_band():
    q = torch.randn(1, 2, 2048, 16)
    bias = relbias.T5Bias(2, bidirectional=False)
    name, reason = relbias.explain_backend(q, q, q, bias=bias, is_causal=True, window=(255, 0))
    assert name == ("toeplitz" if NATIVE else "blockwise"), reason
    with pytest.raises(ValueError, match=r"'structured' cannot run this call: a window \(255, 0\)"):
        relbias.attention(q, q, q, bias=bias, is_causal=True, window=(255, 0), backend="structured")


@pytest.mark.parametrize(
    "window, error, match",
    [
        (128, TypeError, r"pair \(left, right\)"),
        ((1, 2, 3), TypeError, r"pair \(left, right\)"),
        ((True, 0), TypeError, "window left must be an int"),
        ((4, 2.0), TypeError, "window right must be an int"),
        ((-1, 0), ValueError, r"window left must be >= 0.*None.*-1"),
        ((3, -2), ValueError, "window right must be >= 0"),
    ],
)
def test_bad_windows_are_refused_by_name(window, error, match):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(error, match=match):
        relbias.attention(q, q, q, window=window)
    with pytest.raises(error, match=match):
        relbias.explain_backend(q, q, q, window=window)


def test_an_unbounded_window_is_no_window():
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=generator) for _ in range(3))
    bias = relbias.T5Bias(2)
    assert torch.equal(relbias.attention(q, k, v, bias=bias, window=(None, None)), relbias.attention(q, k, v, bias=bias))
