"""relbias._repeat: an inference call repeated with one signature skips validation and dispatch, and still refuses
or reroutes whatever the first call would have: changed bias parameters, NaN/inf in hidden keys, bad arguments."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import relbias
from relbias import _repeat
from relbias.backends import BACKENDS, register_backend, registry, unregister_backend
from relbias.backends.reference import ReferenceBackend
from relbias.call import make_call
from relbias.dispatch import resolve_backend


@pytest.fixture(autouse=True)
def _fresh_memo():
    _repeat.forget()
    yield
    _repeat.forget()


def _qkv(lq=1, lk=24, heads=4, dim=8, dtype=torch.float32):
    return (torch.randn(2, heads, lq, dim, dtype=dtype), torch.randn(2, heads, lk, dim, dtype=dtype),
            torch.randn(2, heads, lk, dim, dtype=dtype))


def _reference(q, k, v, **kwargs):
    return relbias.attention(q, k, v, backend="reference", **kwargs)


def _assert_current_values_read(q, k, v, bias):
    """A repeat of ``attention(q, k, v, bias=bias)`` gives what the reference computes from the bias as it is now."""
    torch.testing.assert_close(relbias.attention(q, k, v, bias=bias), _reference(q, k, v, bias=bias),
                               atol=1e-5, rtol=1e-5)


def test_a_repeated_inference_call_is_kept_and_gives_the_first_calls_output():
    q, k, v = _qkv(lq=4)
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    with torch.no_grad():
        first = relbias.attention(q, k, v, bias=bias, is_causal=True)
        assert len(_repeat._PLANS) == 1
        again = relbias.attention(q, k, v, bias=bias, is_causal=True)
        expected = _reference(q, k, v, bias=bias, is_causal=True)
    assert torch.equal(first, again)  # one code path twice
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=1e-5)


def test_calls_that_need_gradients_or_carry_a_mask_or_dropout_are_not_kept():
    q, k, v = _qkv(lq=4)
    bias = relbias.T5Bias(num_heads=4)
    relbias.attention(q, k, v, bias=bias)  # grad mode on
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, mask=torch.ones(24, dtype=torch.bool))
        relbias.attention(q, k, v, bias=bias, window=(3, 3))
        relbias.attention(q, k, v, bias=bias, dropout_p=0.1)
    assert not _repeat._PLANS


def _table_written_in_place():
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)

    def poison():
        bias.weight[3, 1] = float("nan")

    return bias, lambda: bias.weight.add_(1.0), poison, "holds nan"


def _function_of_outside_state():  # no parameters: its values read more than its state
    state = {"slope": 0.1}
    bias = relbias.FunctionBias(lambda offsets: -state["slope"] * offsets.abs().float())
    return bias, lambda: state.update(slope=2.0), lambda: state.update(slope=float("nan")), "nan"


@pytest.mark.parametrize("make", [_table_written_in_place, _function_of_outside_state])
def test_a_repeat_reads_the_bias_values_as_they_are_now_and_refuses_nan(make):
    bias, change, poison, match = make()
    q, k, v = _qkv()
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias)
        change()  # finite: the new values are read
        _assert_current_values_read(q, k, v, bias)
        poison()
        with pytest.raises(ValueError, match=match):
            relbias.attention(q, k, v, bias=bias)


def test_a_replaced_parameter_is_read():
    q, k, v = _qkv()
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias)
        bias.weight = torch.nn.Parameter(torch.randn_like(bias.weight))
        _assert_current_values_read(q, k, v, bias)


def test_a_parameter_replaced_twice_is_read_even_where_the_allocator_reuses_the_first_ones_place():
    """The second replacement may be allocated where the original was (its object and its storage freed by the
    first): the kept stamp holds the original, so nothing can take its place and every repeat reads the new values
    (without that, about 2% of these trials returned the first call's output)."""
    q, k, v = _qkv()
    for _ in range(100):
        bias = relbias.T5Bias(num_heads=4, bidirectional=False, init_std=1.0)
        with torch.no_grad():
            relbias.attention(q, k, v, bias=bias)
            kept = weakref.ref(bias.weight)
            for _ in range(2):
                bias.weight = torch.nn.Parameter(bias.weight.detach() * 1.3)
            assert kept() is not None  # held by the stamps the caches keep
            _assert_current_values_read(q, k, v, bias)


def test_a_setting_changed_after_a_call_is_read_by_the_next_one():
    """A family's settings are not parameters: assigning one changes the state stamp, so neither a repeat nor the
    native form's memo nor the offset table reuses values of the old settings, and a policy that now refuses does."""
    q, k, v = _qkv(lq=1, lk=60)
    bias = relbias.T5Bias(num_heads=4, bidirectional=False, init_std=1.0)
    per_offset = relbias.PerOffsetBias(max_len=20, num_heads=4, bidirectional=False, init_std=1.0, out_of_range="clip")
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, is_causal=True)
        bias.max_distance, bias.num_buckets = 16, 8  # the table's first 8 rows under another bucketing
        torch.testing.assert_close(relbias.attention(q, k, v, bias=bias, is_causal=True),
                                   _reference(q, k, v, bias=bias, is_causal=True), atol=1e-5, rtol=1e-5)
        relbias.attention(q, k, v, bias=per_offset, is_causal=True)
        per_offset.out_of_range = "error"
        with pytest.raises(ValueError, match="offset 59"):
            relbias.attention(q, k, v, bias=per_offset, is_causal=True)


def test_nan_in_a_hidden_key_on_a_repeat_stays_with_the_queries_that_see_it():
    q, k, v = _qkv(lq=6, lk=6)  # causal, queries on keys 0..5: key 5 is hidden from queries 0..4
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, is_causal=True)
        assert len(_repeat._PLANS) == 1
        v[:, :, 5] = float("nan")
        out = relbias.attention(q, k, v, bias=bias, is_causal=True)
        expected = _reference(q, k, v, bias=bias, is_causal=True)
    assert torch.isfinite(out[:, :, :5]).all() and torch.isnan(out[:, :, 5]).all()
    torch.testing.assert_close(out[:, :, :5], expected[:, :, :5], atol=1e-5, rtol=1e-5)


def test_a_signature_first_seen_with_nan_in_hidden_keys_is_not_kept(monkeypatch):
    """Where decode runs CPU flash (the native kernels off), a NaN in a hidden key sends the call to blockwise,
    which is not the signature's choice for finite keys: not kept (the native decode kernel confines the NaN
    itself, and its signature is kept: tests/backends/test_decode_nonfinite.py)."""
    monkeypatch.setenv("RELBIAS_NATIVE", "0")
    q, k, v = _qkv(lq=6, lk=6)
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    v[:, :, 5] = float("nan")
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, is_causal=True)  # blockwise confines the NaN
    assert not _repeat._PLANS  # a later finite call chooses afresh (the decode kernel)


def _ran_cpu_flash(run) -> bool:
    """Whether ``run()`` ran PyTorch's CPU flash-attention kernel (the decode backend's path without relbias' native
    kernel), by torch's profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return any("scaled_dot_product" in event.key for event in profile.key_averages())


# RELBIAS_NATIVE values that switch the native kernels off (stripped of whitespace, "0"), as Python reads them from
# os.environ: the repeat runner reads os.environ's table in C++ and leaves what it cannot decide (a non-ASCII space)
# to Python
_NATIVE_OFF = {"native off": "0", "native off, spaced": " 0\t", "native off, ASCII separators": "\x1c0\x1f",
               "native off, no-break space": "\u00a00\u00a0"}


def _switch_native_off(monkeypatch, change: str) -> None:
    """RELBIAS_NATIVE=0 as Python reads it (os.environ), set one of several ways."""
    if change in _NATIVE_OFF:
        monkeypatch.setenv("RELBIAS_NATIVE", _NATIVE_OFF[change])
    elif change == "os.environ replaced by a mapping":
        monkeypatch.setattr(os, "environ", {**os.environ, "RELBIAS_NATIVE": "0"})
    else:  # "native off, unset in the C environment only": os.environ still says 0
        monkeypatch.setenv("RELBIAS_NATIVE", "0")
        os.unsetenv("RELBIAS_NATIVE")


def _kept_native_decoding_signature():
    """(q, k, v, bias) of a decoding call kept while relbias' native kernel ran it (skips where it is not built)."""
    from relbias.backends.toeplitz import _native

    if _native.load_native() is None:
        pytest.skip("the native kernels are not built here")
    q, k, v = _qkv(lq=4)
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, is_causal=True)
        assert len(_repeat._PLANS) == 1
        assert not _ran_cpu_flash(lambda: relbias.attention(q, k, v, bias=bias, is_causal=True))
    return q, k, v, bias


@pytest.mark.parametrize("change", [*_NATIVE_OFF, "os.environ replaced by a mapping",
                                    "native off, unset in the C environment only", "keys broadcast along the length"])
def test_a_repeat_the_native_kernel_cannot_run_takes_the_forward(monkeypatch, change):
    """A decoding signature kept while relbias' native kernel ran it: a repeat with the native kernels switched off,
    or with keys the kernel would not read in place, runs the decode backend's flash path and gives its result."""
    q, k, v, bias = _kept_native_decoding_signature()
    with torch.no_grad():
        if change.startswith("keys"):
            k = k[:, :, :1].expand_as(k)  # rows 0 apart: the kernel would copy them
        else:
            _switch_native_off(monkeypatch, change)
        out = []
        assert _ran_cpu_flash(lambda: out.append(relbias.attention(q, k, v, bias=bias, is_causal=True)))
        expected = _reference(q, k, v, bias=bias, is_causal=True)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value, layout", [
    ("1", "contiguous"), ("", "contiguous"), (" 00 ", "contiguous"), ("off", "contiguous"), ("\x010", "contiguous"),
    ("0 in the C environment only", "contiguous"), (None, "keys and values transposed from (B, L, H, D)"),
])
def test_a_repeat_runs_the_native_kernel_unless_relbias_native_is_0(monkeypatch, value, layout):
    """A repeat of a kept decoding signature runs relbias' native kernel for any other RELBIAS_NATIVE value in
    os.environ (or none: a value put only in the C environment is not Python's), and for keys and values it reads in
    place in another layout, and gives the first call's result."""
    q, k, v, bias = _kept_native_decoding_signature()
    if value == "0 in the C environment only":
        monkeypatch.delenv("RELBIAS_NATIVE", raising=False)
        os.putenv("RELBIAS_NATIVE", "0")
    elif value is not None:
        monkeypatch.setenv("RELBIAS_NATIVE", value)
    if layout != "contiguous":  # (B, H, L, D) views of a (B, L, H, D) projection: rows H * D apart
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    try:
        with torch.no_grad():
            first = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="toeplitz")  # the same kernel
            out = []
            assert not _ran_cpu_flash(lambda: out.append(relbias.attention(q, k, v, bias=bias, is_causal=True)))
    finally:
        if value == "0 in the C environment only":
            os.unsetenv("RELBIAS_NATIVE")
    assert len(_repeat._PLANS) == 2  # the repeat kept no new signature (toeplitz's call is the other)
    torch.testing.assert_close(out[0], first, atol=0, rtol=0)  # one kernel, one code path: bit for bit


@pytest.mark.parametrize("bad, error", [
    (dict(is_causal=1), TypeError), (dict(return_lse=1), TypeError), (dict(scale=True), ValueError),
    (dict(dropout_p=False), ValueError), (dict(query_start=True), TypeError), (dict(key_start=False), TypeError),
])
def test_arguments_equal_to_a_kept_signatures_but_of_another_type_are_refused(bad, error):
    q, k, v = _qkv()
    bias = relbias.PerOffsetBias(max_len=64, num_heads=4, bidirectional=False, init_std=0.1)  # "seed": scaled
    kept = dict(is_causal=True, return_lse=True, scale=1, dropout_p=0, query_start=1, key_start=0)
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, **kept)
        assert len(_repeat._PLANS) == 1
        with pytest.raises(error):
            relbias.attention(q, k, v, bias=bias, **{**kept, **bad})


def test_registering_a_backend_forgets_the_kept_choices():
    q, k, v = _qkv()
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    ran = []

    class First(ReferenceBackend):
        name = "first_for_test"

        def forward(self, call):
            ran.append(call)
            return super().forward(call)

    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias)
        register_backend(First(), before=next(iter(BACKENDS)))
        try:
            relbias.attention(q, k, v, bias=bias)
            relbias.attention(q, k, v, bias=bias)
        finally:
            unregister_backend("first_for_test")
    assert len(ran) == 2  # not the kept decode choice, and not kept itself (not repeatable)


def test_another_bias_module_never_takes_a_kept_signature():
    q, k, v = _qkv()
    first = relbias.T5Bias(num_heads=4, bidirectional=False)
    with torch.no_grad():
        relbias.attention(q, k, v, bias=first)
        (signature,) = _repeat._PLANS
        other = relbias.T5Bias(num_heads=4, bidirectional=True)  # another module, with the same parameter
        other.weight = first.weight
        assert _repeat.run(signature, q, k, v, other, False) is None  # as if it had first's id
        assert _repeat.run(signature, q, k, v, first, False) is not None
        del first
        gc.collect()
        assert _repeat.run(signature, q, k, v, other, False) is None


def test_the_memo_is_bounded():
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    with torch.no_grad():
        for lk in range(1, _repeat.MAX_SIGNATURES + 10):
            q, k, v = _qkv(lk=lk)
            relbias.attention(q, k, v, bias=bias)
    assert len(_repeat._PLANS) == _repeat.MAX_SIGNATURES


def test_the_bias_attributes_validation_reads_are_part_of_the_signature():
    q, k, v = _qkv()
    bias = relbias.T5Bias(num_heads=4, bidirectional=True)
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, query_start=3)  # future keys visible
        bias.bidirectional = False
        with pytest.raises(ValueError, match="causal"):
            relbias.attention(q, k, v, bias=bias, query_start=3)
        bias.bidirectional, bias.num_heads = True, 3
        with pytest.raises(ValueError, match="num_heads=3"):
            relbias.attention(q, k, v, bias=bias, query_start=3)


def test_a_choice_made_while_the_registry_changed_is_not_kept():
    q, k, v = _qkv()
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    late = type("Late", (ReferenceBackend,), {"name": "late_for_test"})()
    with torch.no_grad():
        signature = _repeat.signature(q, k, v, bias, None, False, None, None, None, 0, "auto", False, 0.0, None,
                                      None, False, None)
        call = make_call(q, k, v, bias=bias)
        before = registry.generation()
        chosen, _ = resolve_backend("auto", call)
        register_backend(late)  # another thread, while the call runs
        try:
            _repeat.remember(signature, "auto", chosen, call, before)  # chosen against the old registry
            assert not _repeat._PLANS
            during = registry.generation()
        finally:
            unregister_backend("late_for_test")
        _repeat.remember(signature, "late_for_test", late, call, during)  # a backend that has left: no error
    assert signature is not None and not _repeat._PLANS
