"""The ring's arithmetic on one process: blocks at global positions merge by log-sum-exp into the full result,
the gradient of the merge reaches each block as ``w_b dO`` and ``w_b (dO . out_b - dO . out)``, far blocks run
bias-free plus a constant, and a head slice of a bias is the parent's heads."""

from __future__ import annotations

import copy

import pytest
import torch

import relbias
from relbias.backends.structured import far_distance
from relbias.call import make_call
from relbias.distributed import HeadSliceBias, block_kind, merge_partials, slice_heads
from relbias.distributed.ring.blocks import BlockSettings, _band_backend, block_backward, run_block
from relbias.distributed.merge import merge_into

L, PIECE = 60, 12


def _bias(name):
    if name == "t5":
        return relbias.T5Bias(4, num_buckets=8, max_distance=16, init_std=0.5)
    if name == "offset":
        return relbias.PerOffsetBias(max_len=10, num_heads=4, out_of_range="clip", init_std=0.5)
    return relbias.ALiBiBias(4, bidirectional=True)


def _keys(mask, start):
    return None if mask is None else mask[..., start : start + PIECE]


@pytest.mark.filterwarnings("ignore:.*used with is_causal=True")
@pytest.mark.parametrize("kernels", ["native", "flash"])  # a far block's backward: relbias' kernel or PyTorch's
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("name", ["t5", "offset", "alibi"])
def test_blocks_merge_and_backprop_like_full_attention(monkeypatch, name, is_causal, padded, kernels):
    if kernels == "flash":
        monkeypatch.setenv("RELBIAS_NATIVE", "0")
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 4, L, 8, dtype=torch.float64) for _ in range(4))
    mask = torch.ones(2, 1, 1, L, dtype=torch.bool)
    mask[1, ..., :5] = False
    mask = mask if padded else None
    bias = _bias(name).double()
    ref_bias = copy.deepcopy(bias)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = relbias.attention(*leaves, bias=ref_bias, mask=mask, is_causal=is_causal)
    (ref * g).sum().backward()

    call = make_call(q, k, v, bias=bias, is_causal=is_causal)
    settings = BlockSettings(bias, is_causal, call.scale, call.convention, far_distance(bias))
    qs = slice(24, 36)  # one query piece at positions 24..35 against five key pieces
    pieces = [(s, block_kind(24, PIECE, s, PIECE, is_causal=is_causal, far_distance=settings.far_distance))
              for s in range(0, L, PIECE)]
    kinds = {kind for _, kind in pieces}
    assert ("past" in kinds) == (name != "alibi") and ("skip" in kinds) == is_causal
    assert ("future" in kinds) == (name != "alibi" and not is_causal)
    out = torch.zeros(2, 4, PIECE, 8, dtype=torch.float64)
    lse = torch.full((2, 4, PIECE), float("-inf"), dtype=torch.float64)
    for s, kind in pieces:
        if kind != "skip":
            merge_into(out, lse, *run_block(q[:, :, qs], k[:, :, s : s + PIECE], v[:, :, s : s + PIECE],
                                            _keys(mask, s), 24, s, kind, settings))
    torch.testing.assert_close(out, ref[:, :, qs].detach(), atol=1e-12, rtol=1e-10)

    # The gradient of the loss over these 12 queries only, block by block, equals full autograd's.
    for t in leaves + list(ref_bias.parameters()):
        t.grad = None
    ref_rows = relbias.attention(*leaves, bias=ref_bias, mask=mask, is_causal=is_causal)[:, :, qs]
    (ref_rows * g[:, :, qs]).sum().backward()
    params = list(bias.parameters())
    dq = torch.zeros(2, 4, PIECE, 8, dtype=torch.float64)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dparams = [torch.zeros_like(p) for p in params]
    for s, kind in pieces:
        if kind == "skip":
            continue
        ks = slice(s, s + PIECE)
        gq, gk, gv, gp = block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], _keys(mask, s), 24, s, kind, settings,
                                        g[:, :, qs], out.detach(), lse.detach(), params)  # as the ring's (no graph)
        dq += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
        for acc, gi in zip(dparams, gp):
            if gi is not None:
                acc += gi
    torch.testing.assert_close(dq, leaves[0].grad[:, :, qs], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dk, leaves[1].grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dv, leaves[2].grad, atol=1e-12, rtol=1e-10)
    for got, p in zip(dparams, ref_bias.parameters()):
        torch.testing.assert_close(got, p.grad, atol=1e-12, rtol=1e-10)


def test_merge_partials_is_differentiable_and_exact():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    o1, l1 = relbias.attention(q, k[:, :, :3], v[:, :, :3], query_start=0, key_start=0, return_lse=True)
    o2, l2 = relbias.attention(q, k[:, :, 3:], v[:, :, 3:], query_start=0, key_start=3, return_lse=True)
    out, lse = merge_partials(o1, l1, o2, l2)
    ref, ref_lse = relbias.attention(q, k, v, query_start=0, return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.autograd.gradcheck(lambda a, b, c: merge_partials(
        *relbias.attention(a, b[:, :, :3], c[:, :, :3], query_start=0, key_start=0, return_lse=True),
        *relbias.attention(a, b[:, :, 3:], c[:, :, 3:], query_start=0, key_start=3, return_lse=True))[0], (q, k, v))
    empty = torch.full_like(l1, float("-inf"))
    both, m = merge_partials(torch.zeros_like(o1), empty, torch.zeros_like(o2), empty)
    assert torch.equal(both, torch.zeros_like(o1)) and bool((m == float("-inf")).all())


@pytest.mark.parametrize("name", ["t5", "offset", "alibi"])
def test_head_slice_is_the_parents_heads(name):
    torch.manual_seed(2)
    bias = _bias(name)
    part = slice_heads(bias, 1, 3)
    assert isinstance(part, HeadSliceBias) and part.num_heads == 2
    assert part.far_constant_distance() == bias.far_constant_distance()
    torch.testing.assert_close(part(5, 7, query_start=3), bias(5, 7, query_start=3)[1:3])
    q, k, v = (torch.randn(1, 4, 20, 8) for _ in range(3))
    full = relbias.attention(q, k, v, bias=bias)
    torch.testing.assert_close(relbias.attention(q[:, 1:3], k[:, 1:3], v[:, 1:3], bias=part), full[:, 1:3])
    if name != "alibi":
        relbias.attention(q[:, 1:3], k[:, 1:3], v[:, 1:3], bias=part).sum().backward()
        grad = bias.weight.grad
        assert grad[:, [0, 3]].abs().max() == 0 and grad[:, 1:3].abs().max() > 0
    shared = relbias.PerOffsetBias(max_len=4)
    assert slice_heads(shared, 1, 3) is shared and slice_heads(None, 0, 1) is None
    with pytest.raises(ValueError, match="head range"):
        HeadSliceBias(bias, 3, 5)


def test_large_band_blocks_run_the_structured_backend_and_agree():
    torch.manual_seed(3)
    bias = relbias.T5Bias(8, bidirectional=False)
    q, k, v = (torch.randn(1, 8, 256, 16, dtype=torch.float64) for _ in range(3))
    call = make_call(q, k, v, bias=bias, is_causal=True, query_start=256, key_start=0)
    settings = BlockSettings(bias.double(), True, call.scale, call.convention, far_distance(bias))
    kwargs = dict(bias=bias, is_causal=True, scale=call.scale, convention=call.convention, query_start=256,
                  key_start=0, return_lse=True)
    assert _band_backend(make_call(q, k, v, **kwargs), settings) == "structured"
    half = make_call(q[:, :, :128], k, v, **kwargs)
    assert _band_backend(half, settings) == "auto"  # 2^18 scores: auto's choice
    out, lse = run_block(q, k, v, None, 256, 0, "bias", settings)
    ref, ref_lse = relbias.attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
