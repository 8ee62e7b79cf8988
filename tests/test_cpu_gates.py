"""relbias' CPU-dependent gates agree with the machine as the tests read it (tests/_cpu.py: /proc/cpuinfo's flags,
ONEDNN_MAX_CPU_ISA, ATen's capability), so that the tests that route on those readings expect what relbias does:
half precision runs natively exactly where oneDNN may use AMX for it, and decode refuses half precision exactly
where it does not (compiled FlexAttention's head-dim guard below AVX-512: tests/integrations/test_compiled_masks.py
and tests/backends/test_flex_guard.py). On every CPU and under the AVX2 and baseline emulations each test asserts
one side or the other."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends.toeplitz import _native

from ._cpu import assert_cpu_refusal, cpu_refusals, has_matrix_units, native_built


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_natively_exactly_where_oneDNN_may_use_the_matrix_units(dtype):
    if not native_built():
        assert not _native.runs_half(dtype)
        return
    assert _native.runs_half(dtype) == has_matrix_units(dtype), (
        f"runs_half({dtype}) = {_native.runs_half(dtype)}, flags say {has_matrix_units(dtype)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_decoding_step_runs_or_is_refused_by_name(dtype):
    bias = relbias.T5Bias(2, bidirectional=False).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 32, generator=g).to(dtype) for length in (1, 40, 40))
    with torch.no_grad():
        if cpu_refusals("decode", q):
            with pytest.raises(ValueError, match="backend 'decode' cannot run this call") as refused:
                relbias.attention(q, k, v, bias=bias, is_causal=True, backend="decode")
            assert assert_cpu_refusal("decode", str(refused.value), q)
            name, why = relbias.explain_backend(q, k, v, bias=bias, is_causal=True)
            assert name == "toeplitz" and why.count("runs on float32 copies") == 1, why  # the note, once
            return
        got = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="decode")
        want = relbias.attention(q.float(), k.float(), v.float(), bias=bias, is_causal=True, backend="reference")
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)  # one rounding of the output, inputs exact
