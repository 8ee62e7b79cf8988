"""Hostile and edge inputs on every backend of relbias.attention (issue 7).

Each named backend either refuses a call with a clear reason ("backend 'NAME' cannot run this call:
...", the same reason relbias.explain_backend gives) or returns what backend="reference" returns.
Known backend bugs are marked xfail(strict=True) and written up in /work/notes/backend_bugs.md.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch

import relbias
from relbias import PerOffsetBias, T5Bias
from relbias.backends import flex

from ._cases import FAMILY_CASES, FAST_BACKENDS, build_bias, call_or_refusal
from .conftest import BACKEND_NAMES

LENGTHS = [(0, 3), (3, 0), (0, 0), (1, 1), (1, 6), (6, 1), (3, 11), (11, 3), (13, 13)]


def _qkv(b=2, h=2, lq=5, lk=7, d=4, dv=None, dtype=torch.float32):
    return (torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, h, lk, d, dtype=dtype),
            torch.randn(b, h, lk, d if dv is None else dv, dtype=dtype))


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths_0_1_longer_queries_longer_keys_with_and_without_positions(backend, family, small_tiles):
    """9 length pairs x causal/bidirectional x default / explicit positions, forward."""
    refused = 0
    for (lq, lk), is_causal, starts in itertools.product(LENGTHS, (False, True), (None, (4, 1), (-3, 6))):
        bias = build_bias(family, num_heads=2, bidirectional=not is_causal)
        q, k, v = _qkv(lq=lq, lk=lk)
        positions = {} if starts is None else dict(query_start=starts[0], key_start=starts[1])
        if bias is not None and not bias.bidirectional and starts == (-3, 6):
            positions["query_start"] = 10  # a causal-only bias needs no visible future key: is_causal hides them
        with torch.no_grad():
            got = call_or_refusal(backend, q, k, v, bias=bias, is_causal=is_causal, **positions)
            want = relbias.attention(q, k, v, bias=bias, is_causal=is_causal, backend="reference", **positions)
        if isinstance(got, str):
            refused += 1
            assert backend != "blockwise", got  # blockwise runs every bias module, length and position
            continue
        assert got.shape == want.shape == (2, 2, lq, 4) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{lq}x{lk} causal={is_causal} {positions}: {m}")
    if backend == "structured" and family in ("t5", "t5_small", "offset_clip"):
        assert refused == 3 * 2 * 3  # only the three empty blocks
    if backend == "flex" and family != "fire":
        assert refused == 3 * 2 * 3


MASK_SHAPES = [(7,), (5, 7), (1, 1, 5, 7), (2, 1, 1, 7), (2, 2, 5, 7), (1, 2, 1, 1), (2, 1, 5, 1)]
MASK_DTYPES = [torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_masks_of_every_accepted_dtype_and_shape_with_empty_rows(backend, small_tiles):
    q, k, v = _qkv()
    bias = build_bias("t5_small", num_heads=2, bidirectional=True)
    for shape, dtype in itertools.product(MASK_SHAPES, MASK_DTYPES):
        keep = torch.rand(shape) > 0.5
        if len(shape) == 4 and shape[2] == 5:
            keep[..., 1, :] = False  # a query row with no visible key
        mask = keep if dtype == torch.bool else torch.randn(shape).to(dtype).masked_fill(~keep, float("-inf"))
        with torch.no_grad():
            got = call_or_refusal(backend, q, k, v, bias=bias, mask=mask)
            want = relbias.attention(q, k, v, bias=bias, mask=mask, backend="reference")
        if backend in ("structured", "toeplitz", "triton") and (dtype != torch.bool or (len(shape) > 1 and shape[-2] != 1)):
            # they take bool key padding masks only: (7,), (2, 1, 1, 7), (1, 2, 1, 1) here
            assert got.startswith("the mask is not a bool key padding mask"), got
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{shape} {dtype}: {m}")
        empty = ~keep.expand(2, 2, 5, 7).any(-1)
        assert torch.equal(got[empty], torch.zeros_like(got[empty]))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_rows_whose_keys_are_all_in_the_future_are_zero(backend, small_tiles):
    # queries at positions 0..5, keys at 3..13, causal: queries 0, 1, 2 see no key
    bias = build_bias("offset_clip", num_heads=2, bidirectional=True)
    q, k, v = _qkv(lq=6, lk=11)
    with torch.no_grad():
        got = call_or_refusal(backend, q, k, v, bias=bias, is_causal=True, query_start=0, key_start=3)
        want = relbias.attention(q, k, v, bias=bias, is_causal=True, query_start=0, key_start=3, backend="reference")
    assert torch.equal(got[:, :, :3], torch.zeros(2, 2, 3, 4))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("huge", [1e4, 1e30, 3e38])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_huge_positive_bias_on_masked_keys_is_held_back(backend, huge, small_tiles):
    """The bias at offset 3 (a past key, hidden by a mask) and at -3 (a future key, hidden by is_causal)."""
    q, k, v = _qkv(lq=20, lk=20)
    bias = PerOffsetBias(max_len=20, num_heads=2, bidirectional=True, out_of_range="clip")
    offsets = torch.arange(20)[:, None] - torch.arange(20)[None, :]
    for offset, mask, is_causal in ((3, offsets != 3, False), (-3, None, True)):
        with torch.no_grad():
            bias.weight.zero_()
            bias.weight[19 + offset] = huge
        with torch.no_grad():
            got = call_or_refusal(backend, q, k, v, bias=bias, mask=mask, is_causal=is_causal, convention="additive")
            # the same attention without any bias: the huge entry must have had no effect at all
            want = relbias.attention(q, k, v, mask=mask, is_causal=is_causal, convention="additive", backend="reference")
        if isinstance(got, str):
            assert (backend in ("structured", "toeplitz", "triton") and mask is not None) or \
                (backend == "decode" and "queries" in got)
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


BAD_CALLS = [
    ("batch", lambda q, k, v: (q, k[:1], v[:1]), {}, ValueError, "batch sizes differ: query 2, key 1, value 1"),
    ("heads", lambda q, k, v: (q, k, v[:, :1]), {}, ValueError, "num_heads differ: query 2, key 2, value 1"),
    ("head_dim", lambda q, k, v: (q, k[..., :3], v), {}, ValueError, "head_dim differs: query 4, key 3"),
    ("value_len", lambda q, k, v: (q, k, v[:, :, :6]), {}, ValueError, "key_len 7 and value_len 6"),
    ("rank", lambda q, k, v: (q[0], k, v), {}, ValueError, r"query must have shape \(batch, num_heads, seq_len, head_dim\)"),
    ("int", lambda q, k, v: (q.long(), k.long(), v.long()), {}, TypeError, "floating-point tensor .* got torch.int64"),
    ("complex", lambda q, k, v: (q.cfloat(), k.cfloat(), v.cfloat()), {}, TypeError, "got torch.complex64"),
    ("dtypes", lambda q, k, v: (q, k.half(), v), {}, TypeError, "must share one dtype"),
    ("device", lambda q, k, v: (q, k.to("meta"), v), {}, ValueError, "must be on one device, got cpu, meta, cpu"),
    ("mask-device", None, dict(mask=torch.ones(5, 7, dtype=torch.bool, device="meta")), ValueError, "mask is on meta"),
    ("bias-device", None, dict(bias=T5Bias(2).to("meta")), ValueError, "the bias module is on meta"),
    ("bias-tensor-device", None, dict(bias=torch.zeros(5, 7, device="meta")), ValueError, "bias tensor is on meta"),
    ("mask-int", None, dict(mask=torch.ones(5, 7, dtype=torch.int64)), TypeError, "mask must be bool .* got torch.int64"),
    ("mask-complex", None, dict(mask=torch.ones(5, 7, dtype=torch.cfloat)), TypeError, "got torch.complex64"),
    ("mask-shape", None, dict(mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, r"mask of shape \(5, 6\) does not broadcast"),
    ("mask-rank", None, dict(mask=torch.ones(1, 2, 2, 5, 7, dtype=torch.bool)), ValueError, "does not broadcast"),
    ("mask-nan", None, dict(mask=torch.full((5, 7), float("nan"))), ValueError, "contains NaN or \\+inf"),
    ("mask-+inf", None, dict(mask=torch.full((5, 7), float("inf"))), ValueError, "contains NaN or \\+inf"),
    ("bias-shape", None, dict(bias=torch.zeros(3, 5, 7)), ValueError, r"bias of shape \(3, 5, 7\) does not broadcast"),
    ("bias-transposed", None, dict(bias=torch.zeros(7, 5)), ValueError, r"bias of shape \(7, 5\) does not broadcast"),
    ("bias-int", None, dict(bias=torch.zeros(5, 7, dtype=torch.int64)), TypeError, "bias tensor must be floating point"),
    ("bias-nan", None, dict(bias=torch.full((5, 7), float("nan"))), ValueError, "the bias tensor contains NaN or inf"),
    ("bias-heads", None, dict(bias=T5Bias(3)), ValueError, "the bias module has num_heads=3, but query has 2 heads"),
    ("bias-type", None, dict(bias=[0.0]), TypeError, "bias must be a RelativeBias module, a tensor or None"),
    ("causal-only-bias", None, dict(bias=T5Bias(2, bidirectional=False)), ValueError, "some future key is visible"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_bad_arguments_get_the_same_clear_error_whichever_backend_is_named(backend, case, small_tiles):
    _, transform, kwargs, error, message = case
    q, k, v = _qkv()
    args = transform(q, k, v) if transform is not None else (q, k, v)
    with pytest.raises(error, match=message):
        relbias.attention(*args, backend=backend, **kwargs)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_a_bias_tensor_or_a_mask_requiring_grad_is_refused_by_the_fast_backends(backend):
    q, k, v = _qkv()
    assert call_or_refusal(backend, q, k, v, bias=torch.zeros(5, 7)).startswith("the bias is a tensor, already materialised")
    mask = torch.zeros(5, 7, requires_grad=True)
    assert call_or_refusal(backend, q, k, v, bias=T5Bias(2), mask=mask).startswith(
        "the float mask requires grad; only the reference back-propagates into a mask")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_non_contiguous_expanded_and_differently_sized_value_tensors(backend, small_tiles):
    q = torch.randn(2, 13, 2, 4).transpose(1, 2)  # (2, 2, 13, 4), non-contiguous
    k = torch.randn(1, 2, 13, 4).expand(2, -1, -1, -1)  # stride 0 over batch
    v = torch.randn(2, 2, 26, 6)[:, :, ::2]  # every other position: strided, Dv = 6 != D
    bias = build_bias("t5_small", num_heads=2, bidirectional=False)
    with torch.no_grad():
        got = call_or_refusal(backend, q, k, v, bias=bias, is_causal=True)
        want = relbias.attention(q.contiguous(), k.contiguous(), v.contiguous(), bias=bias, is_causal=True,
                                 backend="reference")
    if isinstance(got, str):
        assert backend in ("structured", "decode", "toeplitz") and "value head_dim 6 differs from query head_dim 4" in got
        with torch.no_grad():
            got = relbias.attention(q, k, v[..., :4], bias=bias, is_causal=True, backend=backend)
            want = want.new_tensor(relbias.attention(q, k, v[..., :4].contiguous(), bias=bias, is_causal=True,
                                                     backend="reference"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_nan_in_a_query_reaches_only_that_query(backend, small_tiles):
    q, k, v = _qkv(lq=12, lk=12)
    q[0, 1, 4] = float("nan")
    bias = build_bias("t5_small", num_heads=2, bidirectional=True)
    with torch.no_grad():
        out = call_or_refusal(backend, q, k, v, bias=bias)
    bad = torch.zeros(2, 2, 12, dtype=torch.bool)
    bad[0, 1, 4] = True
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()


def _leaks(backend, case):
    return []  # backend bug 1 (NaN/inf of keys or values a query cannot see reaching it) is fixed


@pytest.mark.parametrize(
    "backend, case",
    [pytest.param(b, c, marks=_leaks(b, c)) for b in BACKEND_NAMES for c in ("padding", "future-value", "future-key")],
)
def test_nan_and_inf_in_keys_a_query_cannot_see_do_not_reach_it(backend, case, small_tiles):
    """relbias.attention's contract: keys no query can see contribute nothing even if they hold NaN/inf, and
    a NaN/inf key or value reaches only the queries that see it."""
    q, k, v = _qkv(lq=20, lk=20)
    bias = build_bias("t5_small", num_heads=2, bidirectional=True)
    mask, is_causal = None, True
    if case == "padding":  # keys 15.. are padding for every query
        k[:, :, 15:], v[:, :, 15:] = float("nan"), float("inf")
        mask, is_causal = torch.arange(20) < 15, False
    elif case == "future-value":  # the last value is seen by the last query only
        v[:, :, 19] = float("nan")
    else:
        k[:, :, 19] = float("inf")
    with torch.no_grad():
        out = call_or_refusal(backend, q, k, v, bias=bias, mask=mask, is_causal=is_causal)
        if isinstance(out, str):  # fused kernels refuse non-finite keys/values; blockwise runs them
            assert backend in ("structured", "flex", "decode", "toeplitz", "triton"), out
            assert "NaN/inf" in out or "queries" in out or (backend == "toeplitz" and "a mask is given" in out), out
            out = relbias.attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal, backend="blockwise")
    if case == "padding":
        want = relbias.attention(q[:, :, :], k[:, :, :15], v[:, :, :15], bias=bias, query_start=0, backend="reference")
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.isfinite(out[:, :, :19]).all()


def _empty_axis_marks(backend, axis):
    reason = {
        # backend bugs 2, 3, 4, 6 (empty batch / heads / head_dim in structured and flex) are fixed
    }.get((backend, axis))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.mark.parametrize(
    "backend, axis",
    [pytest.param(b, a, marks=_empty_axis_marks(b, a)) for b in BACKEND_NAMES for a in ("batch", "heads", "head_dim")],
)
def test_empty_batch_heads_or_head_dim(backend, axis, monkeypatch):
    """An empty batch, no heads or head_dim 0 (scores all 0): the reference's result, or a clear refusal;
    default tile sizes, without and with grad mode (the bias requires grad). Run in a child process: one
    backend kills the interpreter, so that one runs in a child process."""
    shape = {"batch": (0, 2, 600, 8), "heads": (1, 0, 600, 8), "head_dim": (1, 2, 600, 0)}[axis]
    code = textwrap.dedent(f"""
        import torch, relbias, sys
        from relbias.backends import flex
        flex.COMPILE = False
        q = torch.randn{shape}
        v = torch.randn({shape[0]}, {shape[1]}, 600, {shape[3]})
        bias = relbias.T5Bias(1)  # 32 buckets, max_distance 128: far parts beyond 91 tokens
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                try:
                    out = relbias.attention(q, q, v, bias=bias, backend={backend!r})
                except ValueError as exc:
                    assert str(exc).startswith("backend {backend!r} cannot run this call: "), exc
                    continue
                want = relbias.attention(q, q, v, bias=bias, backend="reference")
            assert out.shape == want.shape == ({shape[0]}, {shape[1]}, 600, {shape[3]}), out.shape
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    if (backend, axis) != ("structured", "heads"):
        monkeypatch.setattr(flex, "COMPILE", False)
        exec(code.replace("flex.COMPILE = False", ""), {})
        return
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit status {result.returncode}: {result.stdout[-500:]} {result.stderr[-1500:]}"


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_every_argument_on_the_meta_device_gives_the_shape_or_a_clear_refusal(backend, small_tiles):
    q, k, v = (t.to("meta") for t in _qkv(lq=5, lk=9))
    bias = T5Bias(2, num_buckets=8, max_distance=16).to("meta")
    with torch.no_grad():
        got = call_or_refusal(backend, q, k, v, bias=bias, is_causal=True)
    if isinstance(got, str):
        assert "meta" in got  # names the device it cannot run on
        return
    assert got.shape == (2, 2, 5, 4) and got.device.type == "meta"


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_per_offset_table_too_short_for_the_block(backend, small_tiles):
    q, k, v = _qkv(lq=10, lk=10)
    bias = PerOffsetBias(max_len=8, num_heads=2, bidirectional=False, init_std=1.0)
    with torch.no_grad():
        try:
            got = call_or_refusal(backend, q, k, v, bias=bias, is_causal=True)
        except ValueError as exc:
            assert "offset 9 has no parameter" in str(exc) and "largest offset it knows is 7" in str(exc)
            return
    assert backend == "structured" and "not constant beyond a distance" in got
    # query_start far beyond the table: the same error, however the block is positioned
    with pytest.raises(ValueError, match="has no parameter"):
        relbias.attention(q, k, v, bias=bias, is_causal=True, query_start=100, backend="blockwise")


@pytest.mark.parametrize("bias_dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_bias_parameters_in_another_dtype_than_the_inputs(backend, bias_dtype, small_tiles):
    """float32 inputs with a bias module kept in float64 / float16 / bfloat16: computed in float32, output
    float32, and the bias gradient arrives in the parameters' own dtype, equal to the reference's."""
    q, k, v = _qkv(lq=20, lk=20, d=8)
    bias = T5Bias(2, num_buckets=8, max_distance=16, init_std=1.0).to(bias_dtype)
    with torch.no_grad():
        got = call_or_refusal(backend, q, k, v, bias=bias)
        want = relbias.attention(q, k, v, bias=bias, backend="reference")
    if isinstance(got, str):  # 20 queries: more than a decoding step
        assert backend == "decode" and "queries" in got, got
        pytest.skip(got)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if backend == "flex":
        return  # no FlexAttention backward on CPU
    grads = []
    for name in (backend, "reference"):
        bias.zero_grad()
        relbias.attention(q, k, v, bias=bias, backend=name).pow(2).sum().backward()
        grads.append(bias.weight.grad.clone())
    assert grads[0].dtype == bias_dtype
    tol = 1e-6 if bias_dtype == torch.float64 else 2e-2
    torch.testing.assert_close(grads[0].double(), grads[1].double(), rtol=tol, atol=tol * float(grads[1].abs().max()))
