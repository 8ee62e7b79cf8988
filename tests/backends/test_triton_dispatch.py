"""Where the triton backend runs and what it says: named on CPU under the interpreter it runs and explain_backend
says so; auto never takes it on CPU; calls it cannot run are refused with the reason (no bias, a mask with a query
dimension, bfloat16 under the interpreter, NaN in a hidden key, triton not installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import relbias

from ._triton_cases import require_interpreter

require_interpreter()


def test_named_on_cpu_it_runs_interpreted_and_auto_passes_it_over():
    q = torch.randn(1, 2, 20, 8)
    bias = relbias.T5Bias(2)
    name, reason = relbias.explain_backend(q, q, q, bias=bias, backend="triton")
    assert name == "triton" and "runs under the Triton interpreter (TRITON_INTERPRET=1)" in reason
    name, reason = relbias.explain_backend(q, q, q, bias=bias)
    assert name != "triton" and "not triton: auto takes triton on CUDA only" in reason


@pytest.mark.parametrize("kwargs, words", [
    (dict(), "there is no bias"),
    (dict(bias=relbias.T5Bias(2), mask=torch.ones(20, 20, dtype=torch.bool)), "not a bool key padding mask"),
    (dict(bias=relbias.FIREBias(2)), "FIREBias reads absolute positions"),
    (dict(bias=relbias.T5Bias(2), dtype=torch.bfloat16), "has no bfloat16"),
    (dict(bias=relbias.T5Bias(2), dtype=torch.float64), "not torch.float64"),
    (dict(bias=relbias.T5Bias(2, bidirectional=False), is_causal=True, nan_key=True), "NaN/inf"),
])
def test_calls_it_cannot_run_are_refused_with_the_reason(kwargs, words):
    q = torch.randn(1, 2, 20, 8, dtype=kwargs.pop("dtype", torch.float32))
    k = q.clone()
    if kwargs.pop("nan_key", False):
        k[0, 0, 15] = float("nan")  # hidden from the early queries of a causal call
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call") as refused:
        relbias.attention(q, k, q, backend="triton", **kwargs)
    assert words in str(refused.value)


def test_without_triton_the_reason_says_to_install_the_extra(monkeypatch):
    from relbias.backends.triton import _support

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    _support.triton_missing_reason.cache_clear()
    try:
        q = torch.randn(1, 2, 20, 8)
        with pytest.raises(ValueError, match=r"triton is not installed \(pip install 'relbias\[triton\]'\)"):
            relbias.attention(q, q, q, bias=relbias.T5Bias(2), backend="triton")
    finally:
        _support.triton_missing_reason.cache_clear()


def test_the_device_check_passes_working_kernels_and_refuses_wrong_or_failing_ones(monkeypatch):
    """The one-time check auto runs before using the kernels on a CUDA device, here on the interpreted kernels: it
    passes them, and turns kernels that return wrong values or raise into a refusal naming what went wrong."""
    import relbias.backends.triton as package
    from relbias.backends.triton import _support

    monkeypatch.setattr(_support, "_CHECKED", {})
    cpu = torch.device("cpu")
    assert _support.kernel_check(cpu, torch.float32, 16, 8) is None
    real = package.triton_attention

    def off_by_a_little(call, **kwargs):
        out, lse = real(call, **kwargs)
        return out * 1.001, lse

    monkeypatch.setattr(package, "triton_attention", off_by_a_little)
    reason = _support.kernel_check(cpu, torch.float32, 16, 16)
    assert reason.startswith("the Triton kernels disagree with the reference on cpu (torch.float32, head_dim 16, "
                             "bidirectional): out error")
    monkeypatch.setattr(package, "triton_attention", lambda call, **kwargs: 1 / 0)
    assert "failed on cpu (torch.float32, head_dim 32): ZeroDivisionError" in _support.kernel_check(cpu, torch.float32,
                                                                                                      32, 32)
    assert _support.kernel_check(cpu, torch.float32, 16, 16) == reason  # once per (device, dtype, head dims)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_the_device_check_passes_when_the_first_call_needs_no_gradient(monkeypatch, context):
    """The check differentiates the kernels, so it must not inherit the caller's grad mode: an inference call under
    torch.no_grad() or torch.inference_mode() that comes first must not turn the backend off for the process."""
    from relbias.backends.triton import _support

    monkeypatch.setattr(_support, "_CHECKED", {})
    with context():
        assert _support.kernel_check(torch.device("cpu"), torch.float32, 16, 8) is None
    assert torch.is_grad_enabled()
