"""Local attention (``window=(left, right)``) on the flex backend: the window is part of FlexAttention's block mask,
so tiles wholly outside the band are never visited, and the result equals the reference given the band as a bool
mask (float32, inference: FlexAttention has no CPU backward in torch 2.13), causal and bidirectional, Lq != Lk with
query and key positions, with a key padding mask or a float mask. Eager FlexAttention checks ``mask_mod`` and the
block mask's tiles (visited: some entry visible; full: every entry) against the band written out; compiled
FlexAttention checks that skipped tiles are never read (NaN there changes nothing) and that another window width in
the same length bucket reuses the compiled kernel with its own width."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import relbias
from relbias.backends import flex
from relbias.call import make_call

from .._markers import requires_inductor_vector_isa
from .._tolerance import rounding_tolerance
from .._window_band import band

pytestmark = pytest.mark.skipif(not flex.flex_available(torch.device("cpu"), torch.float32, False)[0],
                                reason="FlexAttention cannot run here")

B, H, D = 2, 2, 32
WINDOWS = [(5, 2), (None, 3), (40, None), (0, 0)]
# (Lq, Lk, query_start, key_start): several 128-row tiles per axis where the lengths allow
BLOCKS = [(300, 300, None, 0), (150, 300, 200, 11), (21, 33, 9, 2), (5, 140, None, 0)]


def _inputs(lq, lk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, lq, D, generator=gen), torch.randn(B, H, lk, D, generator=gen),
            torch.randn(B, H, lk, D, generator=gen))


def _mask(kind, lq, lk, seed=1):
    """None, a bool key padding mask (B, 1, 1, Lk), or a float mask (B, 1, Lq, Lk) with -inf and finite values."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "padding":
        keep = torch.rand(B, 1, 1, lk, generator=gen) > 0.25
        keep[1, ..., : lk // 3] = False
        return keep
    if kind == "float":
        mask = torch.randn(B, 1, lq, lk, generator=gen) * 0.5
        return mask.masked_fill(torch.rand(B, 1, lq, lk, generator=gen) < 0.2, float("-inf"))
    return None


def _with_band(mask, keep):
    """The mask ``mask`` with the band ``keep`` (Lq, Lk) added: a bool or a float mask of the same kind."""
    if mask is None:
        return keep[None, None]
    if mask.dtype == torch.bool:
        return mask & keep[None, None]
    return mask.masked_fill(~keep[None, None], float("-inf"))


def _assert_close(got, want, n):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    got, want = got.masked_fill(torch.isinf(got), 0), want.masked_fill(torch.isinf(want), 0)
    atol, rtol = rounding_tolerance(want, n=n)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return (got - want).abs().max().item()


@pytest.fixture
def block_masks(monkeypatch):
    """The BlockMasks the flex backend builds, in call order."""
    built = []
    real = flex._flex_blocks.block_mask

    def recording(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(flex._flex_blocks, "block_mask", recording)
    return built


def _tiles(block_mask, full: bool) -> torch.Tensor:
    """(Bm, Hm, nQ, nK) bool: the tiles a BlockMask visits with mask_mod (``full=False``, partial) or without it."""
    count = block_mask.full_kv_num_blocks if full else block_mask.kv_num_blocks
    indices = block_mask.full_kv_indices if full else block_mask.kv_indices
    dense = torch.zeros(indices.shape, dtype=torch.bool)
    for where in itertools.product(*(range(n) for n in count.shape)):
        dense[where][indices[where][: count[where]].long()] = True
    return dense


def _expected_tiles(lq, lk, query_start, key_start, window, is_causal, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tiles, (Bm, Hm, nQ, nK), of the padded (bucket(Lq), bucket(Lk)) grid the backend runs: keys
    beyond Lk hidden; the rows of padded queries (dropped afterwards) follow the band at their positions and a mask
    without a query dimension, and see nothing where the mask has one."""
    pq, pk = flex.bucket(lq), flex.bucket(lk)
    query_start = key_start + lk - lq if query_start is None else query_start
    visible = torch.zeros(pq, pk, dtype=torch.bool)
    visible[:, :lk] = band(pq, lk, query_start, key_start, window, is_causal)
    visible = visible[None, None]
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask != float("-inf")
        if keep.shape[2] > 1:
            keep = torch.nn.functional.pad(keep, (0, 0, 0, pq - lq), value=False)
        visible = visible & torch.nn.functional.pad(keep, (0, pk - lk), value=False)
    n = flex._flex_blocks.BLOCK
    tiles = visible.view(*visible.shape[:2], pq // n if pq >= n else 1, min(pq, n), pk // n if pk >= n else 1,
                         min(pk, n))
    some, every = tiles.any(dim=(3, 5)), tiles.all(dim=(3, 5))
    return some & ~every, every


@pytest.mark.parametrize("mask_kind", [None, "padding", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_eager_flex_with_a_window_equals_the_reference_and_its_block_mask_skips_the_tiles_outside(
        is_causal, mask_kind, block_masks, monkeypatch):
    monkeypatch.setattr(flex, "COMPILE", False)  # the same score_mod, mask_mod and block mask, unfused
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=1.0)
    skipped = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention warns that it is unfused
        for (lq, lk, qs, ks), window in itertools.product(BLOCKS, WINDOWS):
            q, k, v = _inputs(lq, lk)
            mask = _mask(mask_kind, lq, lk)
            keep = band(lq, lk, qs, ks, window, is_causal)
            got = relbias.attention(q, k, v, bias=bias, mask=mask, window=window, is_causal=is_causal,
                                    query_start=qs, key_start=ks, backend="flex", return_lse=True)
            want = relbias.attention(q, k, v, bias=bias, mask=_with_band(mask, keep), query_start=qs, key_start=ks,
                                     backend="reference", return_lse=True)
            for g, w in zip(got, want):
                _assert_close(g, w, n=max(lk, D))
            partial, full = _expected_tiles(lq, lk, qs, ks, window, is_causal, mask)
            built = block_masks[-1]
            assert torch.equal(_tiles(built, full=False).expand_as(partial), partial)
            assert torch.equal(_tiles(built, full=True).expand_as(full), full)
            skipped += int((~partial & ~full).sum())
    assert skipped > 0  # some windows leave whole tiles out


@requires_inductor_vector_isa
def test_compiled_flex_never_reads_tiles_outside_the_window_and_reuses_its_kernel_across_widths(block_masks):
    """100 queries on the last of 300 keys (positions 200..299), a causal window of at most 61 keys: key tile 0
    (keys 0..127) is outside every window, so NaN there reaches nothing. Other widths in the same length bucket
    reuse the compiled kernel (the width is a tensor it reads, not a constant in the graph) and get their own
    result; the same call without a window still runs the causal kernel."""
    torch._dynamo.reset()
    flex._compiled.cache_clear()
    bias = relbias.ALiBiBias(H)
    q, k, v = _inputs(100, 300)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :128], v_nan[:, :, :128] = float("nan"), float("nan")
    counters = torch._dynamo.utils.counters
    with torch.no_grad():
        graphs = None
        for window in [(31, 0), (7, 0), (60, 0)]:
            call = make_call(q, k_nan, v_nan, bias=bias, is_causal=True, window=window)
            got, _ = flex.flex_attention(call)  # directly: the backend refuses NaN in a hidden key
            want = relbias.attention(q, k, v, bias=bias, mask=band(100, 300, None, 0, window, True)[None, None],
                                     backend="reference")
            _assert_close(got, want, n=300)
            tiles = _tiles(block_masks[-1], full=False) | _tiles(block_masks[-1], full=True)
            assert not tiles[..., 0].any() and tiles[..., 1:3].all()  # key tile 0 skipped; 1 and 2 visited
            if graphs is None:
                graphs = counters["stats"]["unique_graphs"]
            else:
                assert counters["stats"]["unique_graphs"] == graphs, "another width compiled again"
        got = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="flex")
        _assert_close(got, relbias.attention(q, k, v, bias=bias, is_causal=True, backend="reference"), n=300)


@requires_inductor_vector_isa
@pytest.mark.parametrize("lq, lk, query_start, key_start, window, mask_kind", [
    (300, 300, None, 0, (20, 5), "padding"),  # both sides, key padding; 4 x 4 tiles, 6 of them skipped
    (100, 300, 250, 11, (None, 7), None),  # right side only, positions apart
])
def test_compiled_flex_with_a_bidirectional_window_equals_the_reference(lq, lk, query_start, key_start, window,
                                                                        mask_kind, block_masks):
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=1.0)
    q, k, v = _inputs(lq, lk)
    mask = _mask(mask_kind, lq, lk)
    keep = band(lq, lk, query_start, key_start, window, False)
    with torch.no_grad():
        got = relbias.attention(q, k, v, bias=bias, mask=mask, window=window, query_start=query_start,
                                key_start=key_start, backend="flex")
        want = relbias.attention(q, k, v, bias=bias, mask=_with_band(mask, keep), query_start=query_start,
                                 key_start=key_start, backend="reference")
    _assert_close(got, want, n=lk)
    visited = _tiles(block_masks[-1], full=False) | _tiles(block_masks[-1], full=True)
    assert not visited.all()  # whole tiles outside the band are skipped
