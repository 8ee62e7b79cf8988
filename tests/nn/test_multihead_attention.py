"""MultiheadAttention against torch.nn.MultiheadAttention, cross-attention, padding, shared biases, errors."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.nn import KVCache, MultiheadAttention

E, H = 16, 4


def _torch_reference(layer: MultiheadAttention) -> torch.nn.MultiheadAttention:
    """torch's own module with the same weights (an independent implementation)."""
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))
        ref.out_proj.weight.copy_(layer.out_proj.weight)
        ref.out_proj.bias.copy_(layer.out_proj.bias)
    return ref


@pytest.mark.parametrize("is_causal", [False, True])
def test_without_bias_equals_torch_multihead_attention_with_padding(is_causal):
    layer = MultiheadAttention(E, H, is_causal=is_causal)
    x = torch.randn(2, 7, E)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True  # last two keys of sample 1 are padding (True = ignore, as in torch)
    causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1) if is_causal else None
    expected, _ = _torch_reference(layer)(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(layer(x, key_padding_mask=padding), expected, atol=1e-5, rtol=1e-5)


def _identical_key_layer(**kwargs) -> MultiheadAttention:
    layer = MultiheadAttention(E, H, cross_attention=True, **kwargs)
    with torch.no_grad():
        layer.k_proj.weight.zero_()  # every memory token gets the same key, k_proj.bias
        layer.k_proj.bias.normal_()
    return layer


def test_cross_attention_with_identical_keys_gives_uniform_weights():
    layer = _identical_key_layer()
    query, memory = torch.randn(2, 3, E), torch.randn(2, 5, E)
    mean_value = layer.v_proj(memory).mean(dim=1, keepdim=True)  # uniform weights average the values
    expected = layer.out_proj(mean_value).expand(2, 3, E)
    torch.testing.assert_close(layer(query, memory), expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_padding_averages_only_real_keys():
    layer = _identical_key_layer()
    query, memory = torch.randn(1, 2, E), torch.randn(1, 6, E)
    padding = torch.tensor([[False, False, False, False, True, True]])
    expected = layer.out_proj(layer.v_proj(memory[:, :4]).mean(dim=1, keepdim=True)).expand(1, 2, E)
    torch.testing.assert_close(layer(query, memory, key_padding_mask=padding), expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_uses_a_position_bias_only_when_given():
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=1.0)
    plain, biased = _identical_key_layer(), _identical_key_layer(position_bias=bias)
    biased.load_state_dict(plain.state_dict(), strict=False)
    query, memory = torch.randn(1, 3, E), torch.randn(1, 5, E)
    uniform = plain(query, memory)
    assert not torch.allclose(biased(query, memory), uniform, atol=1e-3)
    # The biased layer's weights are softmax(bias) over memory positions 0..4 for query at position 0.
    weights = torch.softmax(bias(1, 5, query_start=0), dim=-1)  # (H, 1, 5)
    values = biased.v_proj(memory).view(1, 5, H, E // H).transpose(1, 2)  # (1, H, 5, D)
    first = (weights @ values).transpose(1, 2).reshape(1, 1, E)
    torch.testing.assert_close(biased(query[:, :1], memory), biased.out_proj(first), atol=1e-5, rtol=1e-5)


def test_cross_attention_cache_reuses_memory_keys():
    layer = MultiheadAttention(E, H, cross_attention=True)
    query, memory = torch.randn(2, 4, E), torch.randn(2, 5, E)
    cache = KVCache()
    first = layer(query[:, :2], memory, cache=cache)
    second = layer(query[:, 2:], cache=cache)  # memory no longer needed
    torch.testing.assert_close(torch.cat([first, second], 1), layer(query, memory), atol=1e-6, rtol=0)


def test_a_shared_bias_is_one_parameter_set_trained_by_every_layer():
    bias = relbias.T5Bias(H, bidirectional=False)
    layers = torch.nn.ModuleList(MultiheadAttention(E, H, position_bias=bias, is_causal=True) for _ in range(2))
    assert sum(p is bias.weight for p in layers.parameters()) == 1
    x = torch.randn(1, 6, E)
    layers[1](layers[0](x)).sum().backward()
    grad_both = bias.weight.grad.clone()
    bias.weight.grad = None
    layers[1](layers[0](x).detach()).sum().backward()  # only the second layer's contribution
    assert not torch.allclose(grad_both, bias.weight.grad)


def test_per_offset_bias_without_clipping_fails_beyond_its_table():
    bias = relbias.PerOffsetBias(4, num_heads=H, bidirectional=False)
    layer = MultiheadAttention(E, H, position_bias=bias, is_causal=True)
    layer(torch.randn(1, 4, E))
    with pytest.raises(ValueError, match=r"offset 5 has no parameter.*out_of_range='clip'"):
        layer(torch.randn(1, 6, E))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        MultiheadAttention(E, H, backend="nope")
    with pytest.raises(ValueError, match="is_causal applies to self-attention"):
        MultiheadAttention(E, H, cross_attention=True, is_causal=True)
    with pytest.raises(ValueError, match="num_heads=3"):
        MultiheadAttention(E, H, position_bias=relbias.T5Bias(3))
    layer = MultiheadAttention(E, H)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq_len, embed_dim=16\)"):
        layer(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="memory is for cross-attention"):
        layer(torch.randn(1, 2, E), torch.randn(1, 2, E))
    with pytest.raises(TypeError, match="True = padding"):
        layer(torch.randn(1, 2, E), key_padding_mask=torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(batch, key_len\) = \(1, 2\)"):
        layer(torch.randn(1, 2, E), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs memory"):
        MultiheadAttention(E, H, cross_attention=True)(torch.randn(1, 2, E))
