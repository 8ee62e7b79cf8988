"""MultiheadAttention against torch.nn.MultiheadAttention, cross-attention, padding, shared biases, errors."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.nn import KVCache, MultiheadAttention

E, H = 16, 4


def _torch_reference(layer: MultiheadAttention) -> torch.nn.MultiheadAttention:
    """torch's own module with the same weights and layout (an independent implementation)."""
    ref = torch.nn.MultiheadAttention(E, H, batch_first=layer.batch_first)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))
        ref.out_proj.weight.copy_(layer.out_proj.weight)
        ref.out_proj.bias.copy_(layer.out_proj.bias)
    return ref


def _torch_masks(kind: str, batch: int, q_len: int, k_len: int):
    """(key_padding_mask, attn_mask, is_causal) in torch's conventions: True = padding / NOT allowed."""
    padding = torch.zeros(batch, k_len, dtype=torch.bool)
    padding[1, k_len - 2 :] = True  # the last two keys of sample 1 are padding
    causal = torch.triu(torch.ones(q_len, k_len, dtype=torch.bool), diagonal=1)
    if kind == "none":
        return None, None, False
    if kind == "padding":
        return padding, None, False
    if kind == "causal_hint":  # torch needs attn_mask with the is_causal hint
        return padding, causal, True
    if kind == "bool_attn_mask":
        return None, torch.rand(q_len, k_len) < 0.3, False
    if kind == "per_head_bool":
        mask = torch.rand(batch * H, q_len, k_len) < 0.3
        mask[..., 0] = False  # every row keeps a key (torch gives NaN for empty rows)
        return padding, mask, False
    if kind == "float_masks":
        return padding.float() * -1e3, torch.randn(q_len, k_len), False
    raise AssertionError(kind)


MASK_KINDS = ["none", "padding", "causal_hint", "bool_attn_mask", "per_head_bool", "float_masks"]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", MASK_KINDS)
@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_without_bias_equals_torch_multihead_attention(batch_first, masks, need_weights, average):
    layer = MultiheadAttention(E, H, batch_first=batch_first)
    x = torch.randn(2, 7, E) if batch_first else torch.randn(7, 2, E)
    kpm, attn_mask, is_causal = _torch_masks(masks, 2, 7, 7)
    kwargs = dict(key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask,
                  average_attn_weights=average, is_causal=is_causal)
    expected, expected_weights = _torch_reference(layer)(x, x, x, **kwargs)
    out, weights = layer(x, x, x, **kwargs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out.shape == x.shape
    if need_weights:
        assert weights.shape == expected_weights.shape == ((2, 7, 7) if average else (2, H, 7, 7))
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    else:
        assert weights is None and expected_weights is None


@pytest.mark.parametrize("batch_first", [True, False])
def test_cross_attention_without_bias_equals_torch_with_other_kdim_vdim(batch_first):
    layer = MultiheadAttention(E, H, kdim=6, vdim=10, batch_first=batch_first, cross_attention=True)
    ref = torch.nn.MultiheadAttention(E, H, kdim=6, vdim=10, batch_first=batch_first)
    with torch.no_grad():
        for name in "qkv":
            getattr(ref, f"{name}_proj_weight").copy_(getattr(layer, f"{name}_proj").weight)
        ref.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))
        ref.out_proj.load_state_dict(layer.out_proj.state_dict())
    shape = (lambda n: (2, n)) if batch_first else (lambda n: (n, 2))
    query, key, value = torch.randn(*shape(3), E), torch.randn(*shape(5), 6), torch.randn(*shape(5), 10)
    kpm, attn_mask, _ = _torch_masks("per_head_bool", 2, 3, 5)
    expected = ref(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
    got = layer(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-5)


def test_unbatched_inputs_equal_torch():
    layer = MultiheadAttention(E, H)
    x = torch.randn(6, E)  # (seq_len, embed_dim): batch_first does not apply
    kpm = torch.tensor([False] * 4 + [True] * 2)
    expected, expected_weights = _torch_reference(layer)(x, x, x, key_padding_mask=kpm)
    out, weights = layer(x, x, x, key_padding_mask=kpm)
    assert out.shape == (6, E) and weights.shape == (6, 6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


def test_default_layout_is_torchs_sequence_first():
    # A torch user's (L, B, E) input is read as torch reads it, not as (B, L, E).
    layer = MultiheadAttention(E, H)
    assert layer.batch_first is False
    x = torch.randn(5, 3, E)  # (seq_len, batch, embed_dim)
    out, _ = layer(x, x, x)
    first_sample, _ = layer(x[:, :1], x[:, :1], x[:, :1])
    torch.testing.assert_close(out[:, :1], first_sample, atol=1e-6, rtol=0)


def test_weights_with_a_position_bias_are_the_reference_softmax_and_match_the_fast_output():
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=1.0)
    layer = MultiheadAttention(E, H, batch_first=True, position_bias=bias, backend="blockwise")
    x = torch.randn(2, 6, E)
    out, weights = layer(x, x, x, average_attn_weights=False)
    fast, none = layer(x, x, x, need_weights=False)
    assert none is None
    torch.testing.assert_close(out, fast, atol=1e-5, rtol=1e-5)
    q = layer.q_proj(x).view(2, 6, H, E // H).transpose(1, 2)
    k = layer.k_proj(x).view(2, 6, H, E // H).transpose(1, 2)
    expected = torch.softmax(q @ k.transpose(-1, -2) + bias(6, 6), dim=-1)  # T5: unscaled scores
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)


def _identical_key_layer(**kwargs) -> MultiheadAttention:
    layer = MultiheadAttention(E, H, batch_first=True, cross_attention=True, **kwargs)
    with torch.no_grad():
        layer.k_proj.weight.zero_()  # every memory token gets the same key, k_proj.bias
        layer.k_proj.bias.normal_()
    return layer


def test_cross_attention_with_identical_keys_gives_uniform_weights():
    layer = _identical_key_layer()
    query, memory = torch.randn(2, 3, E), torch.randn(2, 5, E)
    mean_value = layer.v_proj(memory).mean(dim=1, keepdim=True)  # uniform weights average the values
    expected = layer.out_proj(mean_value).expand(2, 3, E)
    torch.testing.assert_close(layer(query, memory, memory)[0], expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_padding_averages_only_real_keys():
    layer = _identical_key_layer()
    query, memory = torch.randn(1, 2, E), torch.randn(1, 6, E)
    padding = torch.tensor([[False, False, False, False, True, True]])
    expected = layer.out_proj(layer.v_proj(memory[:, :4]).mean(dim=1, keepdim=True)).expand(1, 2, E)
    torch.testing.assert_close(layer(query, memory, key_padding_mask=padding)[0], expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_uses_a_position_bias_only_when_given():
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=1.0)
    plain, biased = _identical_key_layer(), _identical_key_layer(position_bias=bias)
    biased.load_state_dict(plain.state_dict(), strict=False)
    query, memory = torch.randn(1, 3, E), torch.randn(1, 5, E)
    uniform = plain(query, memory, memory)[0]
    assert not torch.allclose(biased(query, memory, memory)[0], uniform, atol=1e-3)
    # The biased layer's weights are softmax(bias) over memory positions 0..4 for query at position 0.
    weights = torch.softmax(bias(1, 5, query_start=0), dim=-1)  # (H, 1, 5)
    values = biased.v_proj(memory).view(1, 5, H, E // H).transpose(1, 2)  # (1, H, 5, D)
    first = (weights @ values).transpose(1, 2).reshape(1, 1, E)
    torch.testing.assert_close(biased(query[:, :1], memory)[0], biased.out_proj(first), atol=1e-5, rtol=1e-5)


def test_cross_attention_cache_reuses_memory_keys():
    layer = MultiheadAttention(E, H, batch_first=True, cross_attention=True)
    query, memory = torch.randn(2, 4, E), torch.randn(2, 5, E)
    cache = KVCache()
    first, _ = layer(query[:, :2], memory, cache=cache)
    second, _ = layer(query[:, 2:], cache=cache)  # memory no longer needed
    torch.testing.assert_close(torch.cat([first, second], 1), layer(query, memory, memory)[0], atol=1e-6, rtol=0)


def test_a_shared_bias_is_one_parameter_set_trained_by_every_layer():
    bias = relbias.T5Bias(H, bidirectional=False)
    layers = torch.nn.ModuleList(MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=True) for _ in range(2))
    assert sum(p is bias.weight for p in layers.parameters()) == 1
    x = torch.randn(1, 6, E)
    run = lambda layer, h: layer(h, need_weights=False)[0]
    run(layers[1], run(layers[0], x)).sum().backward()
    grad_both = bias.weight.grad.clone()
    bias.weight.grad = None
    run(layers[1], run(layers[0], x).detach()).sum().backward()  # only the second layer's contribution
    assert not torch.allclose(grad_both, bias.weight.grad)


def test_per_offset_bias_without_clipping_fails_beyond_its_table():
    bias = relbias.PerOffsetBias(max_len=4, num_heads=H, bidirectional=False)
    layer = MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=True)
    layer(torch.randn(1, 4, E), need_weights=False)
    for need_weights in (False, True):
        with pytest.raises(ValueError, match=r"offset 5 has no parameter.*out_of_range='clip'"):
            layer(torch.randn(1, 6, E), need_weights=need_weights)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        MultiheadAttention(E, H, backend="nope")
    with pytest.raises(ValueError, match="is_causal applies to self-attention"):
        MultiheadAttention(E, H, cross_attention=True, is_causal=True)
    with pytest.raises(ValueError, match="num_heads=3"):
        MultiheadAttention(E, H, position_bias=relbias.T5Bias(3))
    layer = MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq_len, embed_dim=16\) with batch_first=True"):
        layer(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="self-attention keys and values are the query's own tokens"):
        layer(torch.randn(1, 2, E), torch.randn(1, 3, E), torch.randn(1, 3, E))
    with pytest.raises(ValueError, match=r"key must be .*\(same rank as query, 3-D\)"):
        layer(torch.randn(1, 2, E), torch.randn(2, E))
    with pytest.raises(TypeError, match=r"True = padding\) or float \(additive\)"):
        layer(torch.randn(1, 2, E), key_padding_mask=torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(batch, key_len\) = \(1, 2\)"):
        layer(torch.randn(1, 2, E), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must be \(query_len, key_len\) = \(2, 2\) or"):
        layer(torch.randn(1, 2, E), attn_mask=torch.zeros(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs the memory as key"):
        MultiheadAttention(E, H, cross_attention=True)(torch.randn(1, 2, E))
    with pytest.raises(TypeError, match="batch_first must be a bool"):
        MultiheadAttention(E, H, batch_first=1)
    with pytest.raises(TypeError, match="dropout"):
        MultiheadAttention(E, H, dropout=0.1)  # torch's option: refused by name, never ignored


def test_is_causal_alone_equals_torch_with_the_causal_mask():
    # torch needs attn_mask with its is_causal hint; relbias applies the causal mask from the flag alone.
    layer = MultiheadAttention(E, H)
    x = torch.randn(6, 2, E)
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    expected = _torch_reference(layer)(x, x, x, attn_mask=causal, is_causal=True)
    got = layer(x, x, x, is_causal=True)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["sequence_first", "unbatched"])
def test_cached_decoding_in_torchs_other_layouts(layout):
    bias = relbias.ALiBiBias(H, bidirectional=True)
    cross = MultiheadAttention(E, H, position_bias=bias, cross_attention=True)  # batch_first=False
    shape = (lambda n: (n, 2, E)) if layout == "sequence_first" else (lambda n: (n, E))
    query, memory = torch.randn(*shape(4)), torch.randn(*shape(6))
    full, _ = cross(query, memory, memory)
    cache = relbias.nn.StaticKVCache(2 if layout == "sequence_first" else 1, H, 6, E // H)
    steps = [cross(query[t : t + 1], memory, memory, cache=cache)[0] for t in range(4)]
    torch.testing.assert_close(torch.cat(steps, dim=0), full, atol=1e-5, rtol=0)
