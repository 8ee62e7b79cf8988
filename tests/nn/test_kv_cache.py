"""Incremental decoding equals the full forward, for every registered bias family and both caches."""

from __future__ import annotations

import pytest
import torch

from relbias.biases import FAMILIES
from relbias.experiments import ByteLM, ByteLMConfig
from relbias.nn import KVCache, MultiheadAttention, StaticKVCache

E, H, L = 32, 4, 12  # embed_dim, num_heads, sequence length (tokens)
ATOL = 1e-5  # fp32


def _layer(family, perturbed_bias, *, max_len=L, **options):
    bias = perturbed_bias(family, num_heads=H, max_len=max_len, **options)
    return MultiheadAttention(E, H, position_bias=bias, is_causal=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_token_by_token_with_growing_cache_equals_full(family, perturbed_bias):
    layer = _layer(family, perturbed_bias)
    x = torch.randn(2, L, E)
    full = layer(x)
    cache = KVCache()
    steps = torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(L)], dim=1)
    assert cache.length == L
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_into_non_empty_static_cache_equals_full(family, perturbed_bias):
    layer = _layer(family, perturbed_bias)
    x = torch.randn(2, L, E)
    full = layer(x)
    cache = StaticKVCache(2, H, 16, E // H)
    # 5 tokens into an empty cache, 4 more into the non-empty one, then one at a time,
    # each at an explicit cache position.
    parts = [layer(x[:, :5], cache=cache, cache_position=0), layer(x[:, 5:9], cache=cache, cache_position=5)]
    parts += [layer(x[:, t : t + 1], cache=cache, cache_position=t) for t in range(9, L)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)
    assert cache.length == L


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_into_non_empty_growing_cache_equals_full(family, perturbed_bias):
    layer = _layer(family, perturbed_bias)
    x = torch.randn(1, L, E)
    full = layer(x)
    cache = KVCache()
    out = torch.cat([layer(x[:, :3], cache=cache), layer(x[:, 3:10], cache=cache), layer(x[:, 10:], cache=cache)], 1)
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cache_kind", ["growing", "static"])
def test_rewinding_the_cache_position_overwrites_later_entries(cache_kind, perturbed_bias):
    layer = _layer("t5", perturbed_bias)
    x = torch.randn(1, L, E)
    full = layer(x)
    cache = KVCache() if cache_kind == "growing" else StaticKVCache(1, H, L, E // H)
    layer(x[:, :8], cache=cache)
    layer(torch.randn(1, 2, E), cache=cache)  # two wrong tokens at positions 8, 9 ...
    out = layer(x[:, 8:], cache=cache, cache_position=8)  # ... replaced from position 8 on
    torch.testing.assert_close(out, full[:, 8:], atol=ATOL, rtol=0)
    assert cache.length == L


def test_per_offset_bias_clipped_beyond_max_len_decodes_like_full(perturbed_bias):
    # Sequence longer than the table: clipped offsets must be the same in both paths.
    layer = _layer("offset", perturbed_bias, max_len=4, out_of_range="clip")
    x = torch.randn(1, L, E)
    full = layer(x)
    cache = KVCache()
    steps = torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(L)], dim=1)
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
    reference = MultiheadAttention(E, H, position_bias=bias, is_causal=True, backend="reference")
    tiled = MultiheadAttention(E, H, position_bias=bias, is_causal=True, backend="blockwise")
    tiled.load_state_dict(reference.state_dict())
    x = torch.randn(2, L, E)
    full = reference(x)
    cache = StaticKVCache(2, H, L, E // H)
    out = torch.cat([tiled(x[:, :7], cache=cache)] + [tiled(x[:, t : t + 1], cache=cache) for t in range(7, L)], 1)
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)
