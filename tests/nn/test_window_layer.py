"""MultiheadAttention(window=(left, right)): local attention in every call the layer makes, equal to the reference
backend with the band written out as an explicit mask; windowed KV caches (KVCache trimmed to ``left`` keys,
StaticKVCache as a rolling buffer) decode token by token, in chunks and after a rewind like the full windowed
forward while holding O(W) keys; copies of a windowed layer; bad windows refused by name."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist

import relbias
from relbias.nn import KVCache, MultiheadAttention, StaticKVCache

from .._tolerance import assert_rounding_close
from .._window_band import band

E, H = 24, 3  # embed_dim, num_heads (head_dim 8)
D = E // H
L = 29  # tokens of the decoding runs: several turns of every rolling buffer below
WINDOWS = [(3, 0), (2, 2), (0, 0), (4, None), (None, 1)]


def make_bias(family, *, bidirectional, max_len=12):
    torch.manual_seed(1)
    bias = {
        "t5": lambda: relbias.T5Bias(H, num_buckets=8, max_distance=16, bidirectional=bidirectional, init_std=1.0),
        "alibi": lambda: relbias.ALiBiBias(H, bidirectional=bidirectional),
        # a table of max_len offsets, no clipping: a key read at a wrong position is an error, not a quiet value
        "offset": lambda: relbias.PerOffsetBias(max_len=max_len, num_heads=H, bidirectional=bidirectional,
                                                out_of_range="error", init_std=1.0),
    }[family]()
    return bias


def pair(window, *, is_causal=False, family="t5", cross_attention=False, max_len=12):
    """A windowed layer and the same layer without a window on the reference backend (same weights)."""
    torch.manual_seed(0)
    bias = make_bias(family, bidirectional=not is_causal, max_len=max_len)
    windowed = MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=is_causal, window=window,
                                  cross_attention=cross_attention)
    plain = MultiheadAttention(E, H, batch_first=True, position_bias=bias, is_causal=is_causal, backend="reference",
                               cross_attention=cross_attention)
    plain.load_state_dict(windowed.state_dict())
    return windowed, plain


def close(got, want, n=max(E, L)):
    assert_rounding_close(got, want, n=n)


# ------------------------------------------------------------------------------------------- the layer's calls


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_self_attention_equals_the_reference_with_the_band_as_a_mask(window, is_causal):
    windowed, plain = pair(window, is_causal=is_causal)
    x = torch.randn(2, 19, E)
    hidden = ~band(19, 19, 0, 0, window, is_causal)  # torch's attn_mask: True = NOT allowed
    want, want_weights = plain(x, attn_mask=hidden, average_attn_weights=False)
    close(windowed(x, need_weights=False)[0], want)
    got, weights = windowed(x, average_attn_weights=False)  # need_weights=True: the reference path
    close(got, want)
    close(weights, want_weights)
    assert bool((weights.masked_select(hidden.expand_as(weights)) == 0).all())


def test_cross_attention_windows_target_positions_against_memory_positions():
    windowed, plain = pair((2, 1), cross_attention=True)
    query, memory = torch.randn(2, 6, E), torch.randn(2, 9, E)
    want, want_weights = plain(query, memory, memory, attn_mask=~band(6, 9, 0, 0, (2, 1), False))
    got, weights = windowed(query, memory, memory)
    close(got, want)
    close(weights, want_weights)
    # decoding with a memory cache: the memory is kept whole (never trimmed), the window moves with the target
    for cache in (KVCache(), StaticKVCache(2, H, 9, D)):
        steps = [windowed(query[:, t : t + 1], memory, memory, need_weights=False, cache=cache)[0] for t in range(6)]
        close(torch.cat(steps, 1), want)
        assert cache.length == 9 and cache.key.shape[2] == 9 and cache.query_position == 6


def test_packed_sequences_take_the_window_per_sequence():
    windowed, _ = pair((2, 0), is_causal=True)
    x = torch.randn(1, 12, E)
    packed, _ = windowed(x, cu_seqlens=[0, 5, 12], need_weights=False)
    apart = torch.cat([windowed(x[:, :5], need_weights=False)[0], windowed(x[:, 5:], need_weights=False)[0]], 1)
    close(packed, apart)


# --------------------------------------------------------------------------------------------- windowed caches


def new_cache(kind, left, batch=2):
    return {
        "growing": lambda: KVCache(),
        "static": lambda: StaticKVCache(batch, H, left + 1, D),  # W slots: a step attends from the buffers alone
        "static_tight": lambda: StaticKVCache(batch, H, max(left, 1), D),  # left slots: a step copies its keys
        "static_spare": lambda: StaticKVCache(batch, H, left + 4, D),
    }[kind]()


def numbered(positions, batch=1):
    """Keys and values whose entries are their absolute positions: (B, H, L, D)."""
    k = torch.tensor(positions, dtype=torch.float32).view(1, 1, -1, 1).expand(batch, H, -1, D).clone()
    return k, -k


def test_update_window_returns_runs_of_absolute_positions_in_order():
    static, growing = StaticKVCache(1, H, 5, D), KVCache()
    for t in range(12):  # one token at a time, left = 3
        blocks = static.update_window(*numbered([t]), t, 3)
        (block,) = growing.update_window(*numbered([t]), t, 3)
        assert [b.start for b in blocks][0] == block.start == max(0, t - 3)
        got = torch.cat([b.key[0, 0, :, 0] for b in blocks])
        assert got.tolist() == block.key[0, 0, :, 0].tolist() == list(range(max(0, t - 3), t + 1))
        assert all(torch.equal(b.value, -b.key) for b in blocks)
        assert [b.start + b.key.shape[2] for b in blocks][:-1] == [b.start for b in blocks][1:]  # consecutive runs
    assert len(static.update_window(*numbered([12]), 12, 3)) == 2  # positions 9 .. 12 wrap around slot 4 | 0
    assert (growing.key_start, growing.key.shape[2], static.key_start) == (9, 3, 8)
    # a chunk longer than the buffer: one run (the past keys copied), the buffer keeps the last 5 positions
    (block,) = static.update_window(*numbered(list(range(13, 20))), 13, 3)
    assert (block.start, block.key[0, 0, :, 0].tolist()) == (10, [float(p) for p in range(10, 20)])
    assert sorted(static.key[0, 0, :, 0].tolist()) == [15.0, 16.0, 17.0, 18.0, 19.0] and static.key_start == 15
    with pytest.raises(ValueError, match=r"left must be None \(every past key\) or an int >= 0"):
        KVCache().update_window(*numbered([0]), 0, -1)
    with pytest.raises(TypeError, match=r"left must be None \(every past key\) or an int >= 0"):
        StaticKVCache(1, H, 4, D).update_window(*numbered([0]), 0, 2.0)


def assert_holds_at_most_the_window(cache, left):
    if isinstance(cache, KVCache):
        assert cache.key.shape[2] == cache.value.shape[2] == min(left, cache.length) <= left
        assert cache.key_start == cache.length - cache.key.shape[2]
    else:
        assert cache.key.shape[2] == cache.value.shape[2] == cache.capacity  # fixed buffers, O(W)
        assert cache.length - cache.key_start <= cache.capacity


CACHES = ["growing", "static", "static_tight", "static_spare"]


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("family", ["t5", "alibi", "offset"])
def test_token_by_token_decoding_equals_the_full_windowed_forward(kind, family):
    left = 4  # W = 5 keys; the per-offset table has exactly the W offsets 0 .. 4
    layer, _ = pair((left, 0), is_causal=True, family=family, max_len=left + 1)
    x = torch.randn(2, L, E)
    full, _ = layer(x, need_weights=False)
    cache = new_cache(kind, left)
    steps = []
    for t in range(L):
        steps.append(layer(x[:, t : t + 1], need_weights=False, cache=cache)[0])
        assert_holds_at_most_the_window(cache, left)
        assert cache.length == cache.query_position == t + 1
    close(torch.cat(steps, 1), full)


@pytest.mark.parametrize("kind", CACHES)
def test_chunked_prefill_and_steps_equal_the_full_windowed_forward(kind):
    left = 3
    layer, plain = pair((left, 2), is_causal=True)  # the right side is hidden by the causal rule
    x = torch.randn(2, L, E)
    full, _ = layer(x, need_weights=False)
    close(full, plain(x, attn_mask=~band(L, L, 0, 0, (left, 0), True))[0])
    cache = new_cache(kind, left)
    outs, at = [], 0
    for size in (6, 1, 9, 1, 1, 3, 2, 1, 5):  # chunks longer and shorter than every buffer, at explicit positions
        outs.append(layer(x[:, at : at + size], need_weights=False, cache=cache, cache_position=at)[0])
        at += size
        assert_holds_at_most_the_window(cache, left)
    assert at == L
    close(torch.cat(outs, 1), full)


def test_a_rolling_buffer_with_spare_capacity_rewinds_as_far_as_it_holds_keys():
    left = 3
    layer, _ = pair((left, 0), is_causal=True, family="alibi")
    x = torch.randn(2, L, E)
    full, _ = layer(x, need_weights=False)
    cache = StaticKVCache(2, H, left + 3, D)
    for t in range(20):
        layer(x[:, t : t + 1], need_weights=False, cache=cache)
    layer(torch.randn(2, 3, E), need_weights=False, cache=cache)  # three wrong tokens at 20, 21, 22 ...
    again = layer(x[:, 20:], need_weights=False, cache=cache, cache_position=20)[0]  # ... replaced from 20 on
    close(again, full[:, 20:])
    assert (cache.length, cache.key_start) == (L, L - cache.capacity)
    with pytest.raises(ValueError, match=r"need the keys from position 22 \(left=3\).*holds positions 23 \.\. 28"):
        layer(x[:, 25:26], need_weights=False, cache=cache, cache_position=25)
    trimmed = KVCache()
    for t in range(8):
        layer(x[:, t : t + 1], need_weights=False, cache=trimmed)
    with pytest.raises(ValueError, match="a window dropped the older ones"):
        layer(x[:, 7:8], need_weights=False, cache=trimmed, cache_position=7)
    with pytest.raises(ValueError, match="a window dropped the older ones"):
        trimmed.update(torch.randn(2, H, 1, D), torch.randn(2, H, 1, D), 8)  # every key from 0: dropped


def test_a_static_cache_smaller_than_the_window_is_refused_when_it_would_roll():
    layer, _ = pair((5, 0), is_causal=True)
    cache = StaticKVCache(1, H, 4, D)
    x = torch.randn(1, 6, E)
    layer(x[:, :4], need_weights=False, cache=cache)  # fits: nothing dropped yet
    with pytest.raises(ValueError, match=r"reads 5 past keys.*capacity >= 6"):
        layer(x[:, 4:5], need_weights=False, cache=cache)


def test_weights_with_a_windowed_cache_cover_the_keys_it_attends_to():
    left = 3
    layer, _ = pair((left, 0), is_causal=True)
    x = torch.randn(2, 12, E)
    full, full_weights = layer(x)  # (2, 12, 12)
    for cache in (KVCache(), StaticKVCache(2, H, left + 1, D)):
        for t in range(12):
            out, weights = layer(x[:, t : t + 1], cache=cache)
            first = max(0, t - left)
            assert weights.shape == (2, 1, t + 1 - first)
            close(out, full[:, t : t + 1])
            close(weights, full_weights[:, t : t + 1, first : t + 1])


def test_padding_masks_over_every_position_or_over_the_held_keys_agree():
    left = 3
    layer, _ = pair((left, 0), is_causal=True)
    x = torch.randn(2, 14, E)
    padding = torch.zeros(2, 14, dtype=torch.bool)
    padding[1, 4:9] = True  # sample 1: queries 8 sees only padding in its window (output out_proj of zero)
    full, _ = layer(x, key_padding_mask=padding, need_weights=False)
    for cache_class in (KVCache, lambda: StaticKVCache(2, H, left + 1, D)):
        every, held = cache_class(), cache_class()
        for t in range(14):
            first = max(0, t - left)
            a = layer(x[:, t : t + 1], key_padding_mask=padding[:, : t + 1], need_weights=False, cache=every)[0]
            b = layer(x[:, t : t + 1], key_padding_mask=padding[:, first : t + 1], need_weights=False, cache=held)[0]
            assert torch.equal(a, b)
            close(a, full[:, t : t + 1])
    with pytest.raises(ValueError, match=r"\(batch, key_len\) = \(2, 4\) \(or key_len = 14, every position so far\)"):
        layer(x[:, 13:14], key_padding_mask=padding[:, :3], need_weights=False, cache=every, cache_position=13)


def test_sequence_first_layout_decodes_with_a_rolling_buffer():
    torch.manual_seed(0)
    layer = MultiheadAttention(E, H, position_bias=relbias.ALiBiBias(H), is_causal=True, window=(2, 0))
    x = torch.randn(L, 2, E)  # (seq_len, batch, embed_dim)
    full, _ = layer(x, need_weights=False)
    cache = StaticKVCache(2, H, 3, D)
    close(torch.cat([layer(x[t : t + 1], need_weights=False, cache=cache)[0] for t in range(L)], 0), full)


def test_compiled_steps_with_a_rolling_buffer_equal_eager_and_stop_recompiling():
    """Under torch.compile the rolling buffer hands the window over as one gathered run (no branch on where it
    wraps): the step compiles whole, a few graphs while the buffer fills and first wraps, then none."""
    torch._dynamo.reset()
    layer, _ = pair((3, 0), is_causal=True, family="alibi")
    x = torch.randn(1, 20, E)
    counters = torch._dynamo.utils.counters["stats"]
    with torch.no_grad():
        full, _ = layer(x, need_weights=False)
        cache = StaticKVCache(1, H, 4, D)
        step = torch.compile(lambda x, cache: layer(x, need_weights=False, cache=cache)[0], backend="eager",
                             fullgraph=True)
        out = [step(x[:, t : t + 1], cache) for t in range(12)]
        graphs = counters["unique_graphs"]
        out += [step(x[:, t : t + 1], cache) for t in range(12, 20)]
    assert counters["unique_graphs"] == graphs
    torch._dynamo.reset()
    close(torch.cat(out, 1), full)
    assert (cache.length, cache.key_start) == (20, 16)


# ------------------------------------------------------------------------------------ a module like any other


def test_copies_and_state_dict_of_a_windowed_layer_compute_the_same():
    layer, _ = pair((3, 0), is_causal=True)
    x = torch.randn(2, 10, E)
    layer(x, need_weights=False)[0].sum().backward()  # after a training step ...
    with torch.no_grad():
        cache = StaticKVCache(2, H, 4, D)
        for t in range(10):  # ... and decoding
            layer(x[:, t : t + 1], need_weights=False, cache=cache)
    want = layer(x, need_weights=False)[0]
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    fresh = MultiheadAttention(E, H, batch_first=True, position_bias=make_bias("t5", bidirectional=False),
                               is_causal=True, window=(3, 0))
    fresh.load_state_dict(layer.state_dict())
    copies = {"deepcopy": copy.deepcopy(layer), "pickle": pickle.loads(pickle.dumps(layer)),
              "torch.save": torch.load(buffer, weights_only=False), "state_dict": fresh}
    step = layer(x[:, 9:10], need_weights=False, cache=copy.deepcopy(cache), cache_position=9)[0]
    for way, other in copies.items():
        assert other.window == (3, 0), way
        assert torch.equal(other(x, need_weights=False)[0], want), way
        assert torch.equal(other(x[:, 9:10], need_weights=False, cache=copy.deepcopy(cache), cache_position=9)[0],
                           step), way
    assert "window=(3, 0)" in repr(layer)


def test_from_torch_takes_a_window():
    torch_layer = torch.nn.MultiheadAttention(E, H, batch_first=True)
    layer = MultiheadAttention.from_torch(torch_layer, window=(2, 0), is_causal=True)
    assert layer.window == (2, 0)
    x = torch.randn(2, 9, E)
    want, _ = torch_layer(x, x, x, attn_mask=~band(9, 9, 0, 0, (2, 0), True))
    close(layer(x, need_weights=False)[0], want)


@pytest.mark.parametrize("window, error, message", [
    ((3,), TypeError, r"window must be None or a pair \(left, right\)"),
    (4, TypeError, r"window must be None or a pair \(left, right\)"),
    ((1.5, 0), TypeError, r"window left must be an int >= 0 \(tokens\) or None"),
    ((2, True), TypeError, r"window right must be an int >= 0 \(tokens\) or None"),
    ((-1, 0), ValueError, r"window left must be >= 0 \(tokens\), got -1; for no bound on that side pass None"),
    ((0, -2), ValueError, r"window right must be >= 0"),
])
def test_bad_windows_are_refused_by_name(window, error, message):
    with pytest.raises(error, match=message):
        MultiheadAttention(E, H, window=window)


def test_a_window_that_bounds_nothing_is_none_and_process_groups_keep_windows():
    assert MultiheadAttention(E, H, window=(None, None)).window is None
    assert MultiheadAttention(E, H, window=[4, 0]).window == (4, 0)
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a process group object; torch.distributed not initialised
    layer = MultiheadAttention(E, H, is_causal=True, window=(3, 0), process_group=group)
    assert layer.window == (3, 0) and layer.process_group is group  # tests/distributed runs such layers
