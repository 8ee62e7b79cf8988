"""Every error documented in relbias.attention's docstring, with the words the user sees; and the suite's own
settings that turn relbias' warnings into errors and keep torch's trace logger quiet."""

import logging
import os
import warnings

import pytest
import torch

import relbias
from relbias import PerOffsetBias, T5Bias

from ._cpu import assert_cpu_refusal, cpu_refusals

q = torch.randn(2, 3, 5, 4)
k = torch.randn(2, 3, 7, 4)
v = torch.randn(2, 3, 7, 6)


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        ((q.numpy(), k, v), {}, TypeError, "query must be a torch.Tensor"),
        ((q[0], k, v), {}, ValueError, r"query must have shape \(batch, num_heads, seq_len, head_dim\)"),
        ((q.long(), k.long(), v.long()), {}, TypeError, "floating-point"),
        ((q.to(torch.complex64), k, v), {}, TypeError, "floating-point"),
        ((q, k.double(), v), {}, TypeError, "share one dtype"),
        ((q[:1], k, v), {}, ValueError, "batch sizes differ: query 1, key 2"),
        ((q[:, :2], k, v), {}, ValueError, "num_heads differ: query 2, key 3"),
        ((q[..., :3], k, v), {}, ValueError, "head_dim differs: query 3, key 4"),
        ((q, k, v[:, :, :6]), {}, ValueError, "key_len 7 and value_len 6"),
        ((q, k, v), dict(bias=torch.zeros(3, 5, 6)), ValueError, r"bias of shape \(3, 5, 6\) does not broadcast"),
        ((q, k, v), dict(bias=torch.zeros(4, 5, 7)), ValueError, "does not broadcast"),
        ((q, k, v), dict(bias=torch.zeros(1, 1, 2, 3, 5, 7)), ValueError, "does not broadcast"),
        ((q, k, v), dict(bias=torch.zeros(5, 7, dtype=torch.long)), TypeError, "must be floating point"),
        ((q, k, v), dict(bias=torch.full((5, 7), float("nan"))), ValueError, "NaN or inf"),
        ((q, k, v), dict(bias=[[0.0]]), TypeError, "bias must be a RelativeBias module, a tensor or None"),
        ((q, k, v), dict(bias=T5Bias(2)), ValueError, "num_heads=2, but query has 3 heads"),
        ((q, k, v), dict(mask=torch.ones(5, 7, dtype=torch.int32)), TypeError, "mask must be bool"),
        ((q, k, v), dict(mask=torch.ones(3, 7, dtype=torch.bool)), ValueError, r"mask of shape \(3, 7\) does not broadcast"),
        ((q, k, v), dict(mask=torch.ones(2, 7, dtype=torch.bool)), ValueError, r"looks like a \(batch, key_len\) key padding mask.*mask\[:, None, None, :\]"),
        ((q.transpose(1, 2),) * 3, dict(bias=T5Bias(3)), ValueError, r"transpose a \(batch, seq_len, num_heads"),
        ((q, k, v), dict(mask=torch.full((5, 7), float("nan"))), ValueError, "NaN or \\+inf"),
        ((q, k, v), dict(mask=torch.full((5, 7), float("inf"))), ValueError, "NaN or \\+inf"),
        ((q, k, v), dict(scale=0.0), ValueError, "scale must be a positive finite number, got 0.0"),
        ((q, k, v), dict(scale=float("nan")), ValueError, "positive finite"),
        ((q, k, v), dict(bias=T5Bias(3), scale=0.5), ValueError, "convention 't5' uses unscaled scores"),
        ((q, k, v), dict(convention="sdpa"), ValueError, "convention must be one of"),
        ((q, k, v), dict(backend="magic"), ValueError, "unknown backend 'magic'"),
        ((q, k, v), dict(is_causal=1), TypeError, "is_causal must be a bool"),
        ((q, k, v), dict(query_start=1.0), TypeError, "query_start must be an int"),
        ((q, k, v), dict(bias=PerOffsetBias(max_len=4, num_heads=3)), ValueError, "offset .* has no parameter"),
        ((q, k, v), dict(bias=PerOffsetBias(max_len=9, bidirectional=False)), ValueError, "future keys"),
    ],
)
def test_documented_errors(args, kwargs, error, words):
    with pytest.raises(error, match=words):
        relbias.attention(*args, **kwargs)


def test_meta_device_bias_is_a_device_mismatch():
    bias = T5Bias(3).to("meta")
    with pytest.raises(ValueError, match="bias module is on meta but query is on cpu"):
        relbias.attention(q, k, v, bias=bias)
    with pytest.raises(ValueError, match="one device"):
        relbias.attention(q, k.to("meta"), v)


def test_clipped_per_offset_bias_evaluates_beyond_the_table():
    bias = PerOffsetBias(max_len=4, num_heads=3, out_of_range="clip")
    out = relbias.attention(q, k, v, bias=bias)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- the suite's settings (pyproject.toml, conftest.py)


def _warn_from(module_name: str, category: type[Warning]) -> None:
    """warnings.warn from code whose module is ``module_name``, as a warning raised in (or attributed by its
    stacklevel to) that module is: the filters match the module regex against the frame's ``__name__``."""
    code = compile(f"import warnings\nwarnings.warn('from {module_name}', {category.__name__})", relbias.__file__, "exec")
    exec(code, {"__name__": module_name})


@pytest.mark.parametrize("module_name", ["relbias", "relbias.backends.flex", "relbias.integrations.transformers"])
@pytest.mark.parametrize("category", [UserWarning, DeprecationWarning, RuntimeWarning])
def test_a_warning_from_relbias_code_fails_the_test(module_name, category):
    with pytest.raises(category, match=f"from {module_name}"):
        _warn_from(module_name, category)


@pytest.mark.parametrize("module_name", ["torch.jit._script", "transformers.modeling_utils", "relbiasx"])
def test_a_third_party_warning_is_only_recorded(module_name):
    with warnings.catch_warnings(record=True) as caught:  # keeps the suite's filters; records instead of showing
        _warn_from(module_name, DeprecationWarning)
    assert [str(w.message) for w in caught] == [f"from {module_name}"]


@pytest.mark.skipif(bool(os.environ.get("TORCH_TRACE")), reason="TORCH_TRACE asks for torch's structured trace")
def test_compiling_leaves_no_torch_trace_lines_in_the_captured_log(caplog):
    caplog.set_level(logging.DEBUG)
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert [r for r in caplog.records if r.name.startswith("torch.__trace")] == []


def test_the_sources_compile_without_warnings():
    """An invalid escape such as "\\(" in a plain string warns only when a file is compiled afresh (not from a
    cached .pyc), so compile every source and test file here, with warnings as errors."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "src" / "relbias").rglob("*.py")) + sorted((root / "tests").rglob("*.py"))
    assert len(files) > 20
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text("utf-8"), str(path), "exec")


def test_attn_mask_is_sdpas_name_for_mask_with_sdpas_meaning():
    import torch.nn.functional as F

    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    keep = torch.rand(1, 1, 5, 7) > 0.3
    keep[..., 0] = True  # every query sees a key
    for attn_mask in (keep, torch.zeros(1, 1, 5, 7).masked_fill(~keep, float("-inf"))):
        got = relbias.attention(q, k, v, attn_mask=attn_mask)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))
        assert torch.equal(got, relbias.attention(q, k, v, mask=attn_mask))
        assert relbias.explain_backend(q, k, v, attn_mask=attn_mask) == relbias.explain_backend(q, k, v, mask=attn_mask)
    with pytest.raises(TypeError, match="both mask= and attn_mask=.*True = may attend"):
        relbias.attention(q, k, v, mask=keep, attn_mask=keep)


@pytest.mark.parametrize("backend", ["reference", "blockwise", "decode", "auto"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_float_mask_of_another_dtype_is_added_in_the_computations_dtype(backend, query_dtype, mask_dtype):
    """As documented (SDPA's attn_mask raises for these instead): the mask's values in float32 (float64 for float64
    inputs), the output in the query's dtype. The mask's finite values are exact in every dtype tested, so the
    results equal the float32 (float64) mask's up to the backend's summation order. Where this CPU refuses the call
    by design (decode in bfloat16 without AMX-BF16), the refusal and its reason."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).to(query_dtype) for _ in range(3))
    mask = torch.zeros(1, 1, 5, 5)
    mask[..., 1] = float("-inf")
    mask[..., 3] = -0.5
    compute = torch.float64 if query_dtype == torch.float64 else torch.float32
    bias = relbias.T5Bias(2)
    if cpu_refusals(backend, q):  # decode in bfloat16 where the native kernel runs it on float32 copies
        with torch.no_grad(), pytest.raises(ValueError, match=f"backend '{backend}' cannot run this call") as refused:
            relbias.attention(q, k, v, mask=mask.to(mask_dtype), bias=bias, backend=backend)
        assert assert_cpu_refusal(backend, str(refused.value), q)
        return
    with torch.no_grad():  # decode runs inference only
        got = relbias.attention(q, k, v, mask=mask.to(mask_dtype), bias=bias, backend=backend)
        want = relbias.attention(q, k, v, mask=mask.to(compute), bias=bias, backend=backend)
    assert got.dtype == query_dtype
    torch.testing.assert_close(got, want, atol=1e-2 if query_dtype == torch.bfloat16 else 1e-6, rtol=0)
