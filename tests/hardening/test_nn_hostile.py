"""Hostile and edge inputs on relbias.nn: MultiheadAttention, its caches and ByteLM (issue 7).

Each case gets a clear error naming the offending value, or a result checked against an independent
computation (the functional reference on the layer's own projections).
"""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.nn import KVCache, MultiheadAttention, StaticKVCache

from .._tolerance import assert_rounding_close


def _layer(**kwargs):
    torch.manual_seed(1)
    kwargs.setdefault("position_bias", relbias.T5Bias(2, num_buckets=8, max_distance=16, bidirectional=False,
                                                     init_std=1.0))
    kwargs.setdefault("is_causal", True)
    kwargs.setdefault("batch_first", True)
    return MultiheadAttention(8, 2, **kwargs)


def _out(layer, x, *args, **kwargs):
    """The output of ``layer`` in torch's call form, on the layer's own backend (no weights)."""
    out, weights = layer(x, *args, need_weights=False, **kwargs)
    assert weights is None
    return out


def _by_hand(layer, x, *, mask=None, query_start=0, memory=None, backend="reference"):
    """The layer's forward written out with the functional reference backend."""
    b, n, _ = x.shape
    kv = x if memory is None else memory
    heads = lambda t: t.view(t.shape[0], t.shape[1], 2, 4).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)
    out = relbias.attention(
        heads(layer.q_proj(x)), heads(layer.k_proj(kv)), heads(layer.v_proj(kv)),
        bias=layer.position_bias, mask=mask, is_causal=layer.is_causal, query_start=query_start, backend=backend,
    )
    return layer.out_proj(out.transpose(1, 2).reshape(b, n, 8))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda x: x.long(), TypeError, "query must be a floating-point tensor, got torch.int64"),
        (lambda x: x.to(torch.complex64), TypeError, "query must be a floating-point tensor, got torch.complex64"),
        (lambda x: x.double(), TypeError, "query is torch.float64 but the layer's parameters are torch.float32"),
        (lambda x: x.half(), TypeError, "query is torch.float16 but the layer's parameters are torch.float32"),
        (lambda x: x.to("meta"), ValueError, "query is on meta but the layer's parameters are on cpu"),
        (lambda x: x.numpy(), TypeError, "query must be a tensor"),
        (lambda x: x[0, 0], ValueError, r"query must be \(batch, seq_len, embed_dim=8\) with batch_first=True, or "
                                          r"\(seq_len, embed_dim=8\) unbatched, got \(8,\)"),
        (lambda x: x[None], ValueError, r"embed_dim=8\) unbatched, got \(1, 2, 5, 8\)"),
        (lambda x: x[..., :6], ValueError, r"embed_dim=8\) unbatched, got \(2, 5, 6\)"),
    ],
    ids=["int", "complex", "float64", "float16", "meta-device", "numpy", "rank1", "rank4", "width"],
)
def test_bad_query_gets_a_clear_error(make, error, message):
    with pytest.raises(error, match=message):
        _layer()(make(torch.randn(2, 5, 8)))


def test_a_layer_converted_to_the_input_dtype_runs_and_autocast_is_allowed():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    layer = _layer().double()
    torch.testing.assert_close(_out(layer, x), _by_hand(layer, x))
    layer = _layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _out(layer, x.float().bfloat16())  # bf16 input, float32 parameters: autocast casts
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda m: m.long(), TypeError, "key must be a floating-point tensor, got torch.int64"),
        (lambda m: m.double(), TypeError, "key is torch.float64 but the layer's parameters are torch.float32"),
        (lambda m: m.to("meta"), ValueError, "key is on meta but the layer's parameters are on cpu"),
        (lambda m: m[..., :5], ValueError, r"key must be \(batch, seq_len, kdim=6\) with batch_first=True, or "
                                           r"\(seq_len, kdim=6\) unbatched, got \(2, 3, 5\)"),
        (lambda m: torch.cat([m, m[:1]]), ValueError, "batch sizes differ: query 2, key 3, value 3"),
    ],
    ids=["int", "float64", "meta-device", "kdim", "batch"],
)
def test_bad_memory_gets_a_clear_error(make, error, message):
    layer = MultiheadAttention(8, 2, batch_first=True, cross_attention=True, kdim=6, vdim=6)
    with pytest.raises(error, match=message):
        layer(torch.randn(2, 5, 8), make(torch.randn(2, 3, 6)))


@pytest.mark.parametrize("length", [0, 1, 7])
@pytest.mark.parametrize("backend", ["reference", "blockwise", "structured"])
def test_lengths_0_1_and_more_match_the_functional_reference(length, backend, small_tiles):
    layer = _layer(backend=backend)
    x = torch.randn(2, length, 8)
    if backend == "structured" and length == 0:
        with pytest.raises(ValueError, match="backend 'structured' cannot run this call: an empty axis"):
            _out(layer, x)
        return
    out = _out(layer, x)
    assert out.shape == (2, length, 8)
    torch.testing.assert_close(out, _by_hand(layer, x), rtol=1e-5, atol=1e-6)


def test_flex_backend_in_a_training_layer_on_cpu_is_refused_with_the_reason(small_tiles):
    layer = _layer(backend="flex")
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: FlexAttention has no backward on CPU"):
        _out(layer, torch.randn(1, 4, 8))
    with torch.no_grad():  # forward only: runs, and equals the reference
        x = torch.randn(1, 4, 8)
        torch.testing.assert_close(_out(layer, x), _by_hand(layer, x), rtol=1e-5, atol=1e-6)


def test_all_padding_rows_give_the_output_projection_of_zero_with_finite_gradients():
    layer = _layer(is_causal=False, position_bias=relbias.T5Bias(2, num_buckets=8, max_distance=16, init_std=1.0))
    x = torch.randn(2, 5, 8, requires_grad=True)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1] = True  # batch row 1: every key is padding
    out, weights = layer(x, key_padding_mask=padding)  # weights (reference pass) and the fast path agree
    torch.testing.assert_close(out, _out(layer, x, key_padding_mask=padding), rtol=1e-5, atol=1e-6)
    assert torch.equal(weights[1], torch.zeros(5, 5))  # no visible key: zero weights, not NaN
    out = _out(layer, x, key_padding_mask=padding)
    torch.testing.assert_close(out[1], layer.out_proj.bias.expand(5, 8))  # attention output 0 -> out_proj(0)
    torch.testing.assert_close(out[0], _by_hand(layer, x[:1]).squeeze(0).detach(), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[1], torch.zeros(5, 8))
    for p in layer.parameters():
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize(
    "mask, error, message",
    [
        (torch.zeros(2, 5, dtype=torch.int32), TypeError, "key_padding_mask must be a bool .* or float .* got torch.int32"),
        (torch.zeros(2, 4, dtype=torch.bool), ValueError, r"key_padding_mask must be \(batch, key_len\) = \(2, 5\)"),
        (torch.zeros(1, 5, dtype=torch.bool), ValueError, r"= \(2, 5\)"),
        (torch.zeros(2, 5, dtype=torch.bool, device="meta"), ValueError, "key_padding_mask is on meta"),
    ],
    ids=["float", "short", "batch-1-not-broadcast", "meta-device"],
)
def test_bad_key_padding_masks(mask, error, message):
    with pytest.raises(error, match=message):
        _layer()(torch.randn(2, 5, 8), key_padding_mask=mask)


def test_nan_in_one_token_reaches_only_the_queries_that_see_it():
    layer = _layer()
    x = torch.randn(2, 5, 8)
    x[0, 2] = float("nan")
    out = _out(layer, x)
    assert torch.isnan(out[0, 2:]).all()  # causal: queries 2, 3, 4 see token 2
    assert torch.isfinite(out[0, :2]).all() and torch.isfinite(out[1]).all()


def test_expanded_and_non_contiguous_inputs_equal_contiguous_copies():
    layer = _layer()
    x = torch.randn(1, 5, 8).expand(3, -1, -1)  # stride 0 over batch
    y = torch.randn(5, 3, 8).transpose(0, 1)  # (3, 5, 8), non-contiguous
    assert not x.is_contiguous() and not y.is_contiguous()
    # Other strides reach the projections' GEMMs and the attention kernel as other layouts (another BLAS kernel or
    # a copy, other vector alignment), so the sums may round differently: equal to float32 rounding of the
    # longest sum (the embedding width 8 or the 5 keys).
    assert_rounding_close(_out(layer, x), _out(layer, x.contiguous()), n=8)
    assert_rounding_close(_out(layer, y), _out(layer, y.contiguous()), n=8)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda l, x: l(x, cache=KVCache(), cache_position=-1), ValueError, "cache_position must be an int >= 0"),
        (lambda l, x: l(x, cache=KVCache(), cache_position=3), ValueError, r"cache position 3 is outside \[0, 0\]"),
        (lambda l, x: l(x, cache_position=2), ValueError, "cache_position without a cache"),
        (lambda l, x: l(x, cache=KVCache(), cache_position=1.0), ValueError, "cache_position must be an int"),
        (lambda l, x: l(x, cache=StaticKVCache(2, 2, 4, 4)), ValueError, "beyond the cache capacity 4"),
        (lambda l, x: l(x, cache=StaticKVCache(3, 2, 8, 4)), ValueError, r"do not match the cache buffers \(3, 2, 8, 4\)"),
    ],
    ids=["negative", "gap", "no-cache", "float", "capacity", "static-batch"],
)
def test_bad_cache_use_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call(_layer(), torch.randn(2, 5, 8))


def test_a_cache_refuses_a_changed_batch_or_dtype():
    layer = _layer()
    cache = KVCache()
    _out(layer, torch.randn(2, 5, 8), cache=cache)
    with pytest.raises(ValueError, match=r"do not match the cached \(2, 2, 5, 4\)"):
        _out(layer, torch.randn(3, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="new keys are torch.float64 but the cache holds torch.float32"):
        cache.update(torch.zeros(2, 2, 1, 4, dtype=torch.float64), torch.zeros(2, 2, 1, 4, dtype=torch.float64), 5)


def test_bytelm_rejects_tokens_outside_the_byte_range_and_float_tokens():
    from relbias.experiments import ByteLM
    from relbias.experiments.model import ByteLMConfig

    model = ByteLM(ByteLMConfig(position="t5", max_len=8, embed_dim=8, num_heads=2, num_layers=1))
    with pytest.raises(ValueError, match=r"byte values in \[0, 255\], got 0..256"):
        model(torch.tensor([[0, 256]]))
    with pytest.raises(ValueError, match=r"byte values in \[0, 255\], got -1..3"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="integer tensor of byte values"):
        model(torch.tensor([[0.0, 1.0]]))
    assert model(torch.zeros(2, 0, dtype=torch.long)).shape[:2] == (2, 0)


def test_a_cache_on_another_device_or_dtype_than_the_layer_is_refused_by_name():
    layer = _layer()
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="new keys/values are on cpu/cpu but the cache is on meta"):
        layer(x, cache=StaticKVCache(2, 2, 8, 4, device="meta"))
    cache = KVCache()
    meta = torch.zeros(2, 2, 3, 4, device="meta")
    cache.update(meta, meta, 0)
    with pytest.raises(ValueError, match="new keys/values are on cpu/cpu but the cache is on meta"):
        layer(x, cache=cache)  # before the fix: torch.cat's "Tensor on device cpu is not on the expected device meta!"
    with pytest.raises(ValueError, match="new keys are torch.float32 but the cache holds torch.float64"):
        layer(x, cache=StaticKVCache(2, 2, 8, 4, dtype=torch.float64))
