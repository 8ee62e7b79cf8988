"""The dispatcher's choices and refusals, the far-constant contract the structured backend relies on, and
the tile helpers."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias.backends import structured
from relbias.backends._shared import band_interior as _band_interior
from relbias.backends._shared.bias_tiles import diagonal_sums
from relbias.biases import FAMILIES, make_bias


def _qkv(n=4096, heads=8, requires_grad=False):
    return [torch.zeros(1, heads, n, 64).requires_grad_(requires_grad) for _ in range(3)]  # finite: dispatch reads K/V once


def test_auto_picks_toeplitz_for_a_long_t5_block_on_cpu_and_structured_without_the_native_backward(monkeypatch):
    name, _ = relbias.explain_backend(*_qkv(), bias=relbias.T5Bias(8), is_causal=False)
    native = _toeplitz_native.native_unavailable_reason() is None  # a machine without a C++ compiler: structured
    assert name == ("toeplitz" if native else "structured")
    monkeypatch.setenv("RELBIAS_NATIVE", "0")  # the table needs gradients: the Python tiled backward is slower
    name, reason = relbias.explain_backend(*_qkv(), bias=relbias.T5Bias(8), is_causal=False)
    assert name == "structured" and "far-constant" in reason
    assert "not toeplitz: gradients are needed over 4096x4096 scores" in reason and "RELBIAS_NATIVE=0" in reason
    with torch.no_grad():  # inference: no backward to weigh
        assert relbias.explain_backend(*_qkv(), bias=relbias.T5Bias(8), is_causal=False)[0] == "toeplitz"


def test_auto_takes_toeplitz_for_a_key_padding_mask_and_structured_without_the_native_backward(monkeypatch):
    mask = torch.ones(2, 1, 1, 4096, dtype=torch.bool)
    mask[1, ..., 4000:] = False
    qkv = [x.expand(2, -1, -1, -1) for x in _qkv(requires_grad=True)]
    name, reason = relbias.explain_backend(*qkv, bias=relbias.T5Bias(8), mask=mask)
    native = _toeplitz_native.native_unavailable_reason() is None
    assert name == ("toeplitz" if native else "structured")
    monkeypatch.setenv("RELBIAS_NATIVE", "0")
    name, reason = relbias.explain_backend(*qkv, bias=relbias.T5Bias(8), mask=mask)
    assert name == "structured" and "far-constant" in reason


@pytest.mark.parametrize(
    "mask",
    [torch.zeros(1, 1, 1, 4096), torch.ones(1, 1, 4096, 4096, dtype=torch.bool)],
    ids=["float", "query-dimension"],
)
def test_auto_routes_other_masks_to_blockwise_and_says_why(mask):
    name, reason = relbias.explain_backend(*_qkv(), bias=relbias.T5Bias(8), mask=mask)
    assert name == "blockwise" and "not a bool key padding mask" in reason


@pytest.mark.parametrize("family", ["alibi", "kerple_log", "offset"])
def test_auto_routes_an_offset_only_bias_without_far_constant_to_toeplitz(family):
    bias = make_bias(family, num_heads=8, max_len=4096, bidirectional=False)
    name, reason = relbias.explain_backend(*_qkv(requires_grad=True), bias=bias, is_causal=True)
    assert name == "toeplitz" and "read from its per-offset values" in reason


@pytest.mark.parametrize("family", ["alibi", "kerple_log", "kerple_power", "offset", "t5"])
def test_auto_routes_an_offset_only_bias_with_a_key_padding_mask_to_toeplitz(family):
    mask = torch.ones(1, 1, 1, 4096, dtype=torch.bool)
    mask[..., 3000:] = False
    bias = make_bias(family, num_heads=8, max_len=4096, bidirectional=False)
    name, reason = relbias.explain_backend(*_qkv(), bias=bias, is_causal=True, mask=mask)
    assert name == "toeplitz" and "read from its per-offset values" in reason


@pytest.mark.skipif("fire" not in FAMILIES, reason="FIRE is not registered")
def test_auto_routes_a_family_reading_absolute_positions_to_blockwise():
    bias = make_bias("fire", num_heads=8, max_len=64, bidirectional=False)
    name, reason = relbias.explain_backend(*_qkv(), bias=bias, is_causal=True)
    assert name == "blockwise" and "absolute positions" in reason


def test_auto_materialises_small_blocks_and_tensor_biases():
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool)  # a query dimension: toeplitz (no small-block rule) refuses it
    assert relbias.explain_backend(*_qkv(64), bias=relbias.T5Bias(8), mask=mask)[0] == "reference"
    assert relbias.explain_backend(*_qkv(64), bias=relbias.T5Bias(8))[0] == "toeplitz"
    name, reason = relbias.explain_backend(*_qkv(), bias=torch.zeros(1, 1, 1, 1).expand(1, 1, 4096, 4096))
    assert name == "reference" and "tensor" in reason


@pytest.mark.parametrize(
    "backend, kwargs, requires_grad, message",
    [
        ("structured", dict(bias=make_bias("alibi", num_heads=8, max_len=8, bidirectional=True)), False, "not constant beyond a distance"),
        ("structured", dict(bias=relbias.T5Bias(8), mask=torch.ones(1, 1, dtype=torch.bool).expand(4096, 4096)), False, "not a bool key padding mask"),
        ("flex", dict(bias=relbias.T5Bias(8)), True, "no backward on CPU"),
        ("blockwise", dict(bias=torch.zeros(1, 1).expand(4096, 4096)), False, "already materialised"),
    ],
)
def test_a_named_backend_that_cannot_run_raises_with_the_reason(backend, kwargs, requires_grad, message):
    q, k, v = _qkv(requires_grad=requires_grad)
    with pytest.raises(ValueError, match=f"backend '{backend}' cannot run this call: .*{message}"):
        relbias.explain_backend(q, k, v, backend=backend, **kwargs)
    with pytest.raises(ValueError, match=message):
        relbias.attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], backend=backend, **{
            key: (val[..., :8, :8] if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()
        })


def test_unknown_backend_lists_auto():
    with pytest.raises(ValueError, match=r"unknown backend 'fast'; available: \['auto', 'blockwise'"):
        relbias.explain_backend(*_qkv(8), backend="fast")


@pytest.mark.parametrize(
    "bias",
    [
        relbias.T5Bias(2),
        relbias.T5Bias(2, bidirectional=False),
        relbias.T5Bias(2, num_buckets=8, max_distance=16),
        relbias.T5Bias(2, num_buckets=64, max_distance=300, bidirectional=False),
        relbias.PerOffsetBias(max_len=7, num_heads=2, out_of_range="clip", init_std=1.0),
        relbias.PerOffsetBias(max_len=1, num_heads=2, out_of_range="clip", init_std=1.0),
    ],
    ids=["t5", "t5-causal", "t5-8-16", "t5-64-300-causal", "offset-clip", "offset-clip-L1"],
)
def test_far_constant_distance_is_true(bias):
    # The structured backend is exact only if every offset beyond T has the value of offset +-T.
    distance = structured.far_distance(bias)
    far = torch.arange(distance, distance + 2000)
    values = bias.offset_values(torch.cat([far, -far]) if bias.bidirectional else far)  # (H, n)
    past = values[:, : len(far)]
    assert torch.equal(past, past[:, :1].expand_as(past))
    if bias.bidirectional:
        future = values[:, len(far) :]
        assert torch.equal(future, future[:, :1].expand_as(future))


def test_per_offset_without_clipping_has_no_far_constant():
    assert structured.far_distance(relbias.PerOffsetBias(max_len=8)) is None
    assert relbias.T5Bias(2, bidirectional=False).far_constant_distance() == 113
    assert relbias.T5Bias(2).far_constant_distance() == 91


def test_diagonal_sums_match_a_loop():
    x = torch.randn(2, 5, 7)
    got = diagonal_sums(x)
    for n in range(5 + 7 - 1):
        want = sum(x[:, t, t - (n - 6)] for t in range(5) if 0 <= t - (n - 6) < 7)
        torch.testing.assert_close(got[:, n], want)


def test_structured_batches_interior_band_blocks(monkeypatch, small_tiles):
    calls = []
    original = _band_interior.interior_backward

    def spy(*args, **kwargs):
        calls.append(args[-3:])  # (first, stop, window)
        return original(*args, **kwargs)

    monkeypatch.setattr(_band_interior, "interior_backward", spy)
    monkeypatch.setattr("relbias.backends._shared.tiled_kernel.interior_backward", spy)
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16)
    q, k, v = (torch.randn(1, 2, 90, 8, requires_grad=True) for _ in range(3))
    out = relbias.attention(q, k, v, bias=bias, backend="structured")
    out.sum().backward()
    assert calls and calls[0][1] - calls[0][0] >= 2
    ref_q = q.detach().requires_grad_()
    relbias.attention(ref_q, k.detach(), v.detach(), bias=bias, backend="reference").sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad, rtol=1e-4, atol=1e-5)


def test_explain_backend_takes_every_argument_of_attention():
    import inspect

    takes = inspect.signature(relbias.explain_backend).parameters
    for name, parameter in inspect.signature(relbias.attention).parameters.items():
        assert name in takes and takes[name].default == parameter.default, name


@pytest.mark.parametrize("kwargs", [
    {"dropout_p": 0.1}, {"dropout_p": 0.1, "is_causal": True}, {"return_lse": True}, {"is_causal": True},
], ids=str)
def test_explain_backend_names_the_backend_that_runs_a_training_call(monkeypatch, kwargs):
    """With dropout (toeplitz's native kernels draw it) and without: the named backend is the one whose forward runs,
    and asking draws no dropout seed (the global RNG and a passed generator are left as they were)."""
    ran = []
    for name, backend in relbias.backends.BACKENDS.items():
        monkeypatch.setattr(backend, "forward", lambda call, _f=backend.forward, _n=name: ran.append(_n) or _f(call))
    q, k, v = (torch.randn(1, 2, 1024, 16, requires_grad=True) for _ in range(3))
    bias = relbias.T5Bias(2, bidirectional=not kwargs.get("is_causal", False))
    generator = torch.Generator().manual_seed(1)
    global_state, generator_state = torch.get_rng_state(), generator.get_state()
    name, _ = relbias.explain_backend(q, k, v, bias=bias, generator=generator, **kwargs)
    assert torch.equal(torch.get_rng_state(), global_state) and torch.equal(generator.get_state(), generator_state)
    relbias.attention(q, k, v, bias=bias, generator=generator, **kwargs)
    assert ran == [name]
    native = _toeplitz_native.native_unavailable_reason() is None
    assert name == ("toeplitz" if native or "dropout_p" not in kwargs else "blockwise")


def test_the_reason_gives_the_pick_first_then_each_refusal_on_its_own_line():
    qkv = _qkv(n=512)
    bias = relbias.T5Bias(8)
    name, reason = relbias.explain_backend(*qkv, bias=bias, mask=torch.zeros(1, 1, 512, 512))  # float: blockwise
    first, *passed = reason.split("\n")
    assert name == "blockwise" and first.startswith("blockwise: ") and "window" not in first
    assert [line.split(":")[0] for line in passed] == ["not decode", "not triton", "not flex", "not toeplitz",
                                                       "not structured"]
    name, reason = relbias.explain_backend(*qkv, bias=bias, window=(127, None))
    first = reason.split("\n")[0]
    assert first.startswith(f"{name}: ")
    assert first.endswith("; window=(127, None): each query sees at most 127 of the keys before it and any number "
                          "after it")
    named = relbias.explain_backend(*qkv, bias=bias, window=(3, 0), backend="blockwise")[1]
    call = "bidirectional, offset-only T5Bias, no mask, no dropout, forward and backward, float32"
    assert named == f"blockwise: {call}: " + relbias.backends.BACKENDS["blockwise"].summary + (
        "; window=(3, 0): each query sees at most 3 of the keys before it and at most 0 after it")
