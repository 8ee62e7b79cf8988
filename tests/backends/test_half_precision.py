"""Half precision on CPU: bfloat16 and float16 in the native forward (the CPU's matrix units) and in decoding.

Exactness follows FlashAttention's rule: against the float64 reference on the same (rounded) inputs, a half-precision
result errs at most twice as much as SDPA in that dtype with the same bias materialised (plus one unit of the dtype
at the output's scale, where both are at the output's own rounding). The float32-copy path, which machines without the
matrix units take, is checked to be exactly the float32 computation rounded once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import relbias
from relbias.backends.reference import visible_keys
from relbias.backends.toeplitz import _native
from relbias.backends.toeplitz._view import reversed_bias
from relbias.call import make_call

from ._toeplitz_cases import family_bias

B, H, D = 2, 3, 16
FAMILIES = ("offset_clip", "t5", "alibi", "kerple_log", "kerple_power")

native = pytest.mark.skipif(_native.native_unavailable_reason() is not None,
                            reason=f"native kernels unavailable: {_native.native_unavailable_reason()}")
amx_bf16 = pytest.mark.skipif(not _native.runs_half(torch.bfloat16),
                              reason="bfloat16 runs on float32 copies here (no AMX-BF16 as oneDNN sees this CPU)")


def _inputs(lq, lk, dtype, seed=0, dv=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, lk, dv, generator=g).to(dtype)
    return q, k, v


def _sdpa_materialised(q, k, v, bias, *, is_causal=False, mask=None, window=None):
    """SDPA in the inputs' dtype with the bias (and causal rule, window, mask) materialised as its additive mask."""
    call = make_call(q, k, v, bias=bias, mask=mask, is_causal=is_causal, window=window)
    a = call.alignment
    with torch.no_grad():
        pe = bias(a.query_len, a.key_len, query_start=a.query_start, key_start=a.key_start).double() * call.bias_scale
    visible = visible_keys(mask, is_causal, a, q.device, window)
    additive = pe[None].masked_fill(~visible, float("-inf")).to(q.dtype)
    return _sdpa(q, k, v, additive, call.scale)


def _sdpa(q, k, v, attn_mask, scale):
    """SDPA with an additive mask; its math backend where the CPU flash kernel refuses (torch's own half-precision
    kernel on AMX under ATEN_CPU_CAPABILITY=default: "pack_vnni2 is only supported when avx512 is supported")."""
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    except RuntimeError:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def _reference(q, k, v, bias, **kwargs):
    """The float64 reference on the same (rounded) inputs."""
    return relbias.attention(q.double(), k.double(), v.double(), bias=bias, backend="reference", **kwargs)


def _flash_rule(actual, sdpa, expected):
    """max |actual - expected| <= 2 max |sdpa - expected| + eps(dtype) max |expected|."""
    err = (actual.double() - expected).abs().max().item()
    base = (sdpa.double() - expected).abs().max().item()
    slack = torch.finfo(actual.dtype).eps * expected.abs().max().item()
    assert err <= 2 * base + slack, f"error {err:.3g} against SDPA's {base:.3g} (+{slack:.3g})"


@native
@amx_bf16
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("lq, lk", [(150, 150), (70, 190)])
def test_bfloat16_forward_within_flash_rule(family, is_causal, lq, lk):
    bias, _ = family_bias(family, bidirectional=not is_causal)
    q, k, v = _inputs(lq, lk, torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = relbias.attention(q, k, v, bias=bias, is_causal=is_causal, backend="toeplitz")
        expected = _reference(q, k, v, bias, is_causal=is_causal)
        sdpa = _sdpa_materialised(q, k, v, bias, is_causal=is_causal)
    assert out.dtype == torch.bfloat16
    _flash_rule(out, sdpa, expected)


@native
@amx_bf16
@pytest.mark.parametrize("case", ["window", "padding", "lq1", "long window", "long padding"])
def test_bfloat16_windows_padding_and_one_query(case):
    """Windows, padding and one query; "long": more keys than a key tile (512), so that tiles starting where a window
    or the padding lets them start reach into two of the packed key blocks."""
    bias, _ = family_bias("t5", bidirectional=True)
    lq, lk = {"lq1": (1, 300), "long window": (1100, 1100), "long padding": (700, 1100)}.get(case, (130, 130))
    q, k, v = _inputs(lq, lk, torch.bfloat16, seed=1)
    kwargs = {}
    if case.endswith("window"):
        kwargs["window"] = (20, 7) if case == "window" else (300, 90)
    if case.endswith("padding"):
        keep = torch.ones(B, 1, 1, lk, dtype=torch.bool)
        keep[0, ..., :17 if lk < 512 else 200] = False  # left padding
        keep[1, ..., 100 if lk < 512 else 1000:] = False  # right padding
        keep[1, ..., 40:45] = False  # and some inside
        kwargs["mask"] = keep
    with torch.no_grad():
        out = relbias.attention(q, k, v, bias=bias, backend="toeplitz", **kwargs)
        expected = _reference(q, k, v, bias, **kwargs)
        sdpa = _sdpa_materialised(q, k, v, bias, **kwargs)
    _flash_rule(out, sdpa, expected)


@native
@amx_bf16
def test_bfloat16_dropout_draws_the_reference_mask():
    """Dropout in half precision drops the entries the reference drops (the same counter-based mask)."""
    bias, _ = family_bias("alibi", bidirectional=False)
    q, k, v = _inputs(90, 90, torch.bfloat16, seed=2)
    with torch.no_grad():
        out = relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.3,
                                generator=torch.Generator().manual_seed(5), backend="toeplitz")
        expected = relbias.attention(q.double(), k.double(), v.double(), bias=bias, is_causal=True, dropout_p=0.3,
                                     generator=torch.Generator().manual_seed(5), backend="reference")
        undropped = _reference(q, k, v, bias, is_causal=True)
    err = (out.double() - expected).abs().max().item()
    # rounding of P and of the output: a few units of bfloat16 at the output's scale; a different mask is off by
    # a fraction of the output itself
    assert err <= 4 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    assert (out.double() - undropped).abs().max().item() > 10 * err


@native
@amx_bf16
@pytest.mark.parametrize("is_causal", [True, False])
def test_bfloat16_gradients_within_flash_rule(is_causal):
    """The backward (the native kernel in bfloat16, P and dS rounded for its GEMMs): dq, dk, dv within the rule
    against SDPA's bfloat16 backward with the bias materialised; the bias gradient within float32's resolution of the
    float64 one (bfloat16's would pass with D read from the rounded output)."""
    bias, params = family_bias("t5", bidirectional=not is_causal)
    q, k, v = _inputs(120, 120, torch.bfloat16, seed=3)
    grad = torch.randn(B, H, 120, D, generator=torch.Generator().manual_seed(4)).bfloat16()

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        for p in params:
            p.grad = None
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [t.grad for t in leaves], [None if p.grad is None else p.grad.clone() for p in params]

    ours, ours_bias = grads(lambda *t: relbias.attention(*t, bias=bias, is_causal=is_causal, backend="toeplitz"),
                            torch.bfloat16)
    ref, ref_bias = grads(lambda *t: relbias.attention(*t, bias=bias, is_causal=is_causal, backend="reference"),
                          torch.float64)
    sdpa, _ = grads(lambda *t: _sdpa_materialised(*t, bias, is_causal=is_causal), torch.bfloat16)
    for a, s, e in zip(ours, sdpa, ref):
        assert a.dtype == torch.bfloat16
        _flash_rule(a, s, e)
    for a, e in zip(ours_bias, ref_bias):  # float32's: the backward's D is its own P's, not the rounded output's
        assert (a.double() - e).abs().max().item() <= 256 * torch.finfo(torch.float32).eps * e.abs().max().item()


@native
@amx_bf16
def test_bfloat16_repeats_bit_identical():
    bias, _ = family_bias("kerple_log", bidirectional=True)
    q, k, v = _inputs(200, 200, torch.bfloat16, seed=6)
    with torch.no_grad():
        first = relbias.attention(q, k, v, bias=bias, backend="toeplitz", return_lse=True)
        second = relbias.attention(q, k, v, bias=bias, backend="toeplitz", return_lse=True)
    assert first[1].dtype == torch.float32
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_kernel_against_reference(dtype):
    """The kernel's half-precision instantiations called directly (also where ``auto`` would not take them: the
    GEMM runs without matrix units too, only slower): uneven tiles, causal, a shared bias row."""
    q, k, v = _inputs(37, 53, dtype, seed=7)
    values = torch.randn(1, 37 + 53 - 1, dtype=torch.float64)
    plan = {"scale": D ** -0.5, "delta": 53 - 37, "is_causal": True, "tile_q": 8, "tile_k": 24}
    w = reversed_bias(values, torch.float32, 1.0, True, 53 - 37, 53)
    try:
        out, lse = _native.native_forward(q, k, v, w, plan)
    except RuntimeError as error:  # a libtorch without MKL's half-precision GEMM
        pytest.skip(f"{dtype}: {error}")
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected, expected_lse = _native.native_forward(q.double(), k.double(), v.double(), w.double(), plan)
    index = 37 - 1 - torch.arange(37)[:, None] + torch.arange(53)  # query i, key j read w[Lq - 1 - i + j]
    sdpa = _sdpa(q, k, v, w[0, index].to(dtype), plan["scale"])
    _flash_rule(out, sdpa, expected)
    assert (lse.double() - expected_lse).abs().max().item() < 0.05


@native
def test_without_matrix_units_half_runs_on_float32_copies(monkeypatch):
    """Where runs_half says no (a CPU without AMX), a bfloat16 call is the float32 computation rounded once, and
    explain_backend says so."""
    monkeypatch.setattr(_native, "runs_half", lambda dtype: False)
    bias, _ = family_bias("t5", bidirectional=True)
    bias = bias.float()
    q, k, v = _inputs(64, 64, torch.bfloat16, seed=8)
    with torch.no_grad():
        out = relbias.attention(q, k, v, bias=bias, backend="toeplitz")
        copies = relbias.attention(q.float(), k.float(), v.float(), bias=bias, backend="toeplitz")
    assert torch.equal(out, copies.to(torch.bfloat16))
    name, why = relbias.explain_backend(q, k, v, bias=bias.requires_grad_(False))
    assert "float32 copies" in why
    assert name == "toeplitz"


@native
@amx_bf16
@pytest.mark.parametrize("lk", [16, 300])
def test_bfloat16_decoding_reads_the_cache_in_place(lk):
    """A decoding step on a bfloat16 cache runs the decode backend's native kernel: no copy of the cache (no
    conversion in the profile), within the rule against SDPA bfloat16 with the bias row materialised."""
    bias = relbias.T5Bias(H, bidirectional=False).requires_grad_(False)
    q, k, v = _inputs(1, lk, torch.bfloat16, seed=9)
    name, why = relbias.explain_backend(q, k, v, bias=bias, is_causal=True)
    assert name == "decode" and "AMX-BF16" in why
    with torch.no_grad(), torch.profiler.profile(record_shapes=True) as prof:
        out = relbias.attention(q, k, v, bias=bias, is_causal=True)
    # the first call builds the bias's small offset table (conversions of its values); none of the cache's size
    copies = [e.input_shapes for e in prof.events() if e.name in ("aten::to", "aten::_to_copy", "aten::copy_")
              and any(shape and shape[-2:] == [lk, D] for shape in e.input_shapes)]
    assert copies == []
    with torch.no_grad():
        expected = _reference(q, k, v, bias, is_causal=True)
        sdpa = _sdpa_materialised(q, k, v, bias, is_causal=True)
    _flash_rule(out, sdpa, expected)


@native
@amx_bf16
@pytest.mark.parametrize("case", ["causal", "right_padding", "left_padding"])
def test_bfloat16_kernel_keeps_nan_values_to_the_queries_that_see_them(case):
    """The half-precision kernel (packed operands) keeps a NaN value to the queries that see its key, as the float32
    one does (the dispatcher sends such calls elsewhere; decode relies on it): a causal call's later queries; none
    behind right padding that ends on an odd key (the packed P v product reads one key past such a tile, P 0 there);
    none in left padding that ends inside a 64-key block (the packed tiles start on the block: NaN key and value
    there, which the tile reads but no row sees)."""
    q, k, v = _inputs(200, 200, torch.bfloat16, seed=10)
    nan_key = {"causal": 150, "right_padding": 101, "left_padding": 5}[case]
    v[:, :, nan_key] = float("nan")
    if case == "left_padding":
        k[:, :, nan_key] = float("nan")
    causal = case == "causal"
    values = torch.randn(1, 399, dtype=torch.float64)
    w = reversed_bias(values, torch.float32, 1.0, causal, 0, 200)
    hidden = {"causal": None, "right_padding": torch.arange(200) >= 101, "left_padding": torch.arange(200) < 10}[case]
    padding = None if hidden is None else torch.zeros(1, 1, 200).masked_fill(hidden, float("-inf"))
    plan = {"scale": D ** -0.5, "delta": 0, "is_causal": causal, "tile_q": 64, "tile_k": 128}
    out, _ = _native.native_forward(q, k, v, w, plan, key_padding=padding)
    clean = v.clone()
    clean[:, :, nan_key] = 0
    expected, _ = _native.native_forward(q.double(), k.double(), clean.double(), w.double(), plan,
                                         key_padding=padding)
    seen = slice(0, nan_key) if causal else slice(0, 200)
    if causal:
        assert out[:, :, nan_key:].isnan().all()
    assert out[:, :, seen].isfinite().all()
    assert (out[:, :, seen].double() - expected[:, :, seen]).abs().max().item() < 0.05
