"""Incremental decoding equals the full forward, for every registered bias family and both caches."""

from __future__ import annotations

import pytest
import torch

from relbias.biases import FAMILIES
from relbias.experiments import ByteLM, ByteLMConfig
from relbias.nn import KVCache, MultiheadAttention, StaticKVCache

E, H, L = 32, 4, 12  # embed_dim, num_heads, sequence length (tokens)
ATOL = 1e-5  # fp32


def _run(layer, x, **kwargs):
    """Self-attention in torch's call form, on the layer's own backend (need_weights=False)."""
    out, weights = layer(x, x, x, need_weights=False, **kwargs)
    assert weights is None
    return out


def _layer(family, perturbed_bias, *, max_len=L, **options):
    bias = perturbed_bias(family, num_heads=H, max_len=max_len, **options)
    return MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_token_by_token_with_growing_cache_equals_full(family, perturbed_bias):
    layer = _layer(family, perturbed_bias)
    x = torch.randn(2, L, E)
    full = _run(layer, x)
    cache = KVCache()
    steps = torch.cat([_run(layer, x[:, t : t + 1], cache=cache) for t in range(L)], dim=1)
    assert cache.length == L
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_into_non_empty_static_cache_equals_full(family, perturbed_bias):
    layer = _layer(family, perturbed_bias)
    x = torch.randn(2, L, E)
    full = _run(layer, x)
    cache = StaticKVCache(2, H, 16, E // H)
    # 5 tokens into an empty cache, 4 more into the non-empty one, then one at a time,
    # each at an explicit cache position.
    parts = [_run(layer, x[:, :5], cache=cache, cache_position=0), _run(layer, x[:, 5:9], cache=cache, cache_position=5)]
    parts += [_run(layer, x[:, t : t + 1], cache=cache, cache_position=t) for t in range(9, L)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)
    assert cache.length == L


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_into_non_empty_growing_cache_equals_full(family, perturbed_bias):
    layer = _layer(family, perturbed_bias)
    x = torch.randn(1, L, E)
    full = _run(layer, x)
    cache = KVCache()
    out = torch.cat([_run(layer, x[:, :3], cache=cache), _run(layer, x[:, 3:10], cache=cache), _run(layer, x[:, 10:], cache=cache)], 1)
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cache_kind", ["growing", "static"])
def test_rewinding_the_cache_position_overwrites_later_entries(cache_kind, perturbed_bias):
    layer = _layer("t5", perturbed_bias)
    x = torch.randn(1, L, E)
    full = _run(layer, x)
    cache = KVCache() if cache_kind == "growing" else StaticKVCache(1, H, L, E // H)
    _run(layer, x[:, :8], cache=cache)
    _run(layer, torch.randn(1, 2, E), cache=cache)  # two wrong tokens at positions 8, 9 ...
    out = _run(layer, x[:, 8:], cache=cache, cache_position=8)  # ... replaced from position 8 on
    torch.testing.assert_close(out, full[:, 8:], atol=ATOL, rtol=0)
    assert cache.length == L


def test_per_offset_bias_clipped_beyond_max_len_decodes_like_full(perturbed_bias):
    # Sequence longer than the table: clipped offsets must be the same in both paths.
    layer = _layer("offset", perturbed_bias, max_len=4, out_of_range="clip")
    x = torch.randn(1, L, E)
    full = _run(layer, x)
    cache = KVCache()
    steps = torch.cat([_run(layer, x[:, t : t + 1], cache=cache) for t in range(L)], dim=1)
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("capacity", [None, 16])
def test_language_model_decodes_like_full_forward(family, capacity):
    options = {"out_of_range": "clip"} if family == "offset" else {}
    model = ByteLM(ByteLMConfig(position=family, position_options=options, max_len=8, embed_dim=32, num_layers=2))
    with torch.no_grad():
        for bias in model.position_biases:
            for p in bias.parameters():
                p.add_(0.3 * torch.randn_like(p)) if bool((p == 0).all()) else p.mul_(1.2)
    tokens = torch.randint(0, 256, (2, L))
    full = model(tokens)
    cache = model.make_cache(2, capacity=capacity)
    out = torch.cat([model(tokens[:, :5], cache=cache)] + [model(tokens[:, t : t + 1], cache=cache) for t in range(5, L)], 1)
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)


def test_cache_errors_name_the_problem():
    cache = KVCache()
    k = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"cache position 5 is outside \[0, 0\]"):
        cache.update(k, k, 5)
    static = StaticKVCache(1, 2, 4, 4)
    static.update(k, k, 0)
    with pytest.raises(ValueError, match="beyond the cache capacity 4"):
        static.update(k, k, 3)
    with pytest.raises(ValueError, match="do not match the cache buffers"):
        static.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), 3)
    with pytest.raises(TypeError, match="must be an int"):
        cache.update(k, k, 0.0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiled_backend_decodes_like_the_reference_full_forward(family, perturbed_bias):
    # The tiled path receives the cache's absolute positions too (query_start, key_start).
    bias = perturbed_bias(family, num_heads=H, max_len=L)
    reference = MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=True, backend="reference")
    tiled = MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=True, backend="blockwise")
    tiled.load_state_dict(reference.state_dict())
    x = torch.randn(2, L, E)
    full = _run(reference, x)
    cache = StaticKVCache(2, H, L, E // H)
    out = torch.cat([_run(tiled, x[:, :7], cache=cache)] + [_run(tiled, x[:, t : t + 1], cache=cache) for t in range(7, L)], 1)
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)


# Issue 14, item 1: a cached query's position is its own token index in the target sequence, tracked
# by the cache (cache.query_position) -- never derived from the length of what the cache holds.
LQ, LM = 5, 7  # target and memory lengths of the cross-attention cases


def _new_cache(cache_class, batch, capacity):
    return KVCache() if cache_class is KVCache else StaticKVCache(batch, H, capacity, E // H)


def _kind_layer(kind, perturbed_bias, family):
    if kind == "self_causal":
        bias = perturbed_bias(family, num_heads=H, max_len=L)
        return MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=True)
    bias = perturbed_bias(family, num_heads=H, max_len=LM, bidirectional=True)
    return MultiheadAttention(E, H, batch_first=True, position_bias=bias, cross_attention=True)


@pytest.mark.parametrize("cache_class", [KVCache, StaticKVCache])
@pytest.mark.parametrize("kind", ["self_causal", "cross_with_bias"])
@pytest.mark.parametrize("family", ["alibi", "t5", "offset", "fire"])
def test_every_layer_kind_decodes_token_by_token_like_the_full_pass(kind, cache_class, family, perturbed_bias):
    layer = _kind_layer(kind, perturbed_bias, family)
    if kind == "self_causal":
        x = torch.randn(2, L, E)
        full = _run(layer, x)
        cache = _new_cache(cache_class, 2, L)
        steps = [_run(layer, x[:, t : t + 1], cache=cache) for t in range(L)]
        assert cache.query_position == cache.length == L
    else:
        query, memory = torch.randn(2, LQ, E), torch.randn(2, LM, E)
        full, _ = layer(query, memory, memory, need_weights=False)
        cache = _new_cache(cache_class, 2, LM)
        # memory passed every step (as generate() does) and also left out once the cache holds it
        steps = [layer(query[:, t : t + 1], memory if t % 2 else None, need_weights=False, cache=cache)[0]
                 if t else layer(query[:, :1], memory, memory, need_weights=False, cache=cache)[0] for t in range(LQ)]
        assert (cache.query_position, cache.length) == (LQ, LM)  # target tokens vs memory tokens
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_class", [KVCache, StaticKVCache])
def test_cross_attention_issue_example_prefill_then_steps_and_rewind(cache_class, perturbed_bias):
    # The issue's 5 x 7 example: bidirectional ALiBi; before the fix rows 1..4 differed by 1.5e-2 .. 3.6e-2.
    layer = _kind_layer("cross_with_bias", perturbed_bias, "alibi")
    query, memory = torch.randn(1, LQ, E), torch.randn(1, LM, E)
    full, full_weights = layer(query, memory, memory)
    cache = _new_cache(cache_class, 1, LM)
    first, _ = layer(query[:, :2], memory, memory, cache=cache)  # prefill two target tokens
    rest = [layer(query[:, t : t + 1], cache=cache) for t in range(2, LQ)]
    torch.testing.assert_close(torch.cat([first] + [o for o, _ in rest], 1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(rest[-1][1], full_weights[:, -1:], atol=1e-6, rtol=0)
    # rewinding the target position re-runs query 3 at position 3, not at the memory length
    again, _ = layer(query[:, 3:4], cache=cache, cache_position=3)
    torch.testing.assert_close(again, full[:, 3:4], atol=1e-5, rtol=0)
    assert cache.query_position == 4
    with pytest.raises(ValueError, match=r"query position 6 is outside \[0, 4\]"):
        layer(query[:, :1], cache=cache, cache_position=6)


def test_a_cache_serves_one_kind_of_layer():
    self_layer = MultiheadAttention(E, H, batch_first=True, is_causal=True)
    cross_layer = MultiheadAttention(E, H, batch_first=True, cross_attention=True)
    x = torch.randn(1, 3, E)
    cache = KVCache()
    _run(self_layer, x, cache=cache)
    with pytest.raises(ValueError, match="holds self-attention keys"):
        cross_layer(x, x, x, cache=cache)
    memory_cache = StaticKVCache(1, H, 4, E // H)
    cross_layer(x, x, x, cache=memory_cache)
    with pytest.raises(ValueError, match="holds a cross-attention memory"):
        _run(self_layer, x, cache=memory_cache)
