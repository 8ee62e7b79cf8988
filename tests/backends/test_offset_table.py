"""The decode backend's offset table: one reversed, scaled per-offset vector serving every decoding step, grown
geometrically, rebuilt when the bias changes, refused where the family has no value."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import relbias
from relbias.backends._shared import offset_table
from relbias.backends._shared.offset_table import MIN_CAPACITY, SPAN, reversed_rows
from relbias.backends.toeplitz import _native
from relbias.backends.toeplitz._view import reversed_bias
from relbias.call import make_call

from ..hardening._cases import build_bias

FAMILIES = ["t5", "t5_small", "offset_clip", "alibi", "kerple_log", "offset"]


def _step(bias, key_len, query_len=1, **kwargs):
    """A decoding call: ``query_len`` queries on the last of ``key_len`` keys, causal."""
    q = torch.randn(1, 2, query_len, 8)
    k, v = torch.randn(1, 2, key_len, 8), torch.randn(1, 2, key_len, 8)
    return q, k, v, dict(bias=bias, is_causal=True, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_step_reads_the_values_of_its_own_offsets(family):
    """Across the first capacity's end (keys 255..258) and a chunk of queries (future offsets -inf), the table's
    view holds exactly the values the native form gives for that block (the same arithmetic: bit-equal)."""
    bias = build_bias(family, num_heads=2, bidirectional=False, max_len=1024)
    with torch.no_grad():
        for key_len, query_len in [(1, 1), (40, 1), (255, 1), (256, 1), (257, 1), (300, SPAN + 1), (700, 3)]:
            q, k, v, kwargs = _step(bias, key_len, query_len)
            call = make_call(q, k, v, **kwargs)
            got = reversed_rows(call, torch.float32)
            assert got is not None and got.shape == (2, query_len + key_len - 1)
            want = reversed_bias(call.native_bias().values, torch.float32, call.bias_scale, True, call.delta, key_len)
            assert torch.equal(got, want)


def test_steps_share_one_table_until_the_keys_outgrow_it():
    bias = relbias.T5Bias(2, bidirectional=False)
    with torch.no_grad():
        views = [reversed_rows(make_call(*_step(bias, n)[:3], **_step(bias, n)[3]), torch.float32)
                 for n in (10, 11, MIN_CAPACITY)]
        grown = reversed_rows(make_call(*_step(bias, MIN_CAPACITY + 1)[:3], **_step(bias, MIN_CAPACITY + 1)[3]),
                              torch.float32)
    storages = {view.untyped_storage().data_ptr() for view in views}
    assert len(storages) == 1  # no step before the capacity computed anything
    assert grown.untyped_storage().data_ptr() not in storages
    assert grown.untyped_storage().nbytes() == 2 * (2 * MIN_CAPACITY + SPAN) * 4  # doubled


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_step_by_step_equals_the_reference(family):
    bias = build_bias(family, num_heads=2, bidirectional=False, max_len=1024)
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 600, 8), torch.randn(1, 2, 600, 8)
    with torch.no_grad():
        for key_len in (1, 2, 255, 256, 257, 511, 512, 513, 600):
            q = torch.randn(1, 2, 1, 8)
            call = dict(bias=bias, is_causal=True, return_lse=True)
            got = relbias.attention(q, k[:, :, :key_len], v[:, :, :key_len], backend="decode", **call)
            want = relbias.attention(q, k[:, :, :key_len], v[:, :, :key_len], backend="reference", **call)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_changed_parameter_rebuilds_the_table():
    bias = relbias.T5Bias(2, bidirectional=False)
    q, k, v, kwargs = _step(bias, 50)
    with torch.no_grad():
        before = relbias.attention(q, k, v, backend="decode", **kwargs)
        bias.weight.add_(torch.randn_like(bias.weight))  # in place: same storage, a new version
        after = relbias.attention(q, k, v, backend="decode", **kwargs)
        want = relbias.attention(q, k, v, backend="reference", **kwargs)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)


def test_offsets_past_a_per_offset_table_still_raise():
    """A capacity beyond ``max_len`` must not turn the missing offsets into values: the family's error stays."""
    bias = relbias.PerOffsetBias(max_len=300, num_heads=2, bidirectional=False)
    with torch.no_grad():
        q, k, v, kwargs = _step(bias, 300)
        relbias.attention(q, k, v, backend="decode", **kwargs)  # offsets 0..299: all defined; table of 512
        q, k, v, kwargs = _step(bias, 301)
        with pytest.raises(ValueError, match="offset 300 has no parameter"):
            relbias.attention(q, k, v, backend="decode", **kwargs)


def test_no_table_for_gradients_compiled_positions_or_far_future_offsets():
    bias, causal = relbias.T5Bias(2, bidirectional=True), relbias.T5Bias(2, bidirectional=False)
    q, k, v, kwargs = _step(causal, 64)
    assert reversed_rows(make_call(q, k, v, **kwargs), torch.float32) is None  # the table requires grad
    with torch.no_grad():
        # the query before most keys: offsets down to -63, future ones bidirectional, beyond SPAN causal
        assert reversed_rows(make_call(q, k, v, bias=bias, query_start=0), torch.float32) is None
        assert reversed_rows(make_call(q, k, v, bias=causal, query_start=0, is_causal=True), torch.float32) is None


def test_a_decoded_bias_copies_without_its_table():
    bias = relbias.T5Bias(2, bidirectional=False)
    q, k, v, kwargs = _step(bias, 80)
    with torch.no_grad():
        out = relbias.attention(q, k, v, backend="decode", **kwargs)
        assert bias in offset_table._TABLES
        for clone in (copy.deepcopy(bias), pickle.loads(pickle.dumps(bias))):
            assert clone not in offset_table._TABLES and not any(torch.is_tensor(x) for x in vars(clone).values())
            assert torch.equal(relbias.attention(q, k, v, backend="decode", **{**kwargs, "bias": clone}), out)


@pytest.mark.skipif(_native.load_native() is None, reason="the native kernels are not built here")
def test_the_native_forward_reads_a_bias_view_with_any_row_stride():
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 20, 8), torch.randn(1, 3, 20, 8)
    table = torch.randn(3, 50)
    view = table[:, 7:28]  # (3, Lq + Lk - 1), rows 50 apart
    module = _native.load_native()
    got = module.toeplitz_forward(q, k, v, view, 0.3, 18, True, 256, 512, True)
    want = module.toeplitz_forward(q, k, v, view.contiguous(), 0.3, 18, True, 256, 512, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="unit stride"):
        module.toeplitz_forward(q, k, v, table.t().contiguous().t()[:, 7:28], 0.3, 18, True, 256, 512, True)
