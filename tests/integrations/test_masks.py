"""Hugging Face 4D masks -> (mask, is_causal) for relbias: same visible keys, compact where possible."""

import pytest
import torch

from relbias import relative_offsets
from relbias.integrations.masks import relbias_mask_from_hf


def visibility(mask, is_causal, query_len, key_len, query_start):
    """(B or 1, 1, Lq, Lk) bool: which keys the converted pair lets each query see."""
    visible = torch.ones(1, 1, query_len, key_len, dtype=torch.bool)
    if is_causal:
        visible = visible & (relative_offsets(query_len, key_len, query_start=query_start) >= 0)
    if mask is not None:
        visible = visible & (mask if mask.dtype == torch.bool else mask != float("-inf"))
    return visible


def padding(lengths, key_len, left=False):
    """(B, Lk) bool, True for real tokens."""
    positions = torch.arange(key_len)
    rows = [(positions >= key_len - n) if left else (positions < n) for n in lengths]
    return torch.stack(rows)


def hf_masks(key_padding, query_len, query_start, causal):
    """The bool and the float mask transformers' sdpa_mask / eager_mask build for these inputs."""
    masking = pytest.importorskip("transformers.masking_utils", reason="transformers is not installed")
    function = masking.causal_mask_function if causal else masking.bidirectional_mask_function
    kwargs = dict(
        batch_size=key_padding.shape[0], q_length=query_len, kv_length=key_padding.shape[1], q_offset=query_start,
        mask_function=function, attention_mask=key_padding,
    )
    return masking.sdpa_mask(allow_is_causal_skip=False, **kwargs), masking.eager_mask(**kwargs)


@pytest.mark.parametrize("left", [False, True])
def test_encoder_padding_becomes_key_padding(left):
    key_padding = padding([9, 6, 9], 9, left=left)
    for hf in hf_masks(key_padding, 9, 0, causal=False):
        mask, is_causal = relbias_mask_from_hf(hf, is_causal=False)
        assert not is_causal and mask.shape == (3, 1, 1, 9) and mask.dtype == torch.bool
        assert torch.equal(mask[:, 0, 0], key_padding)


@pytest.mark.parametrize("query_len, query_start", [(7, 0), (1, 6), (3, 4)])
def test_decoder_padding_and_causal_become_key_padding(query_len, query_start):
    key_len = query_start + query_len
    key_padding = padding([key_len, key_len - 2], key_len, left=True)
    for hf in hf_masks(key_padding, query_len, query_start, causal=True):
        expected = hf if hf.dtype == torch.bool else hf == 0
        mask, is_causal = relbias_mask_from_hf(hf, is_causal=True, query_start=query_start)
        assert is_causal and mask.shape == (2, 1, 1, key_len)
        assert torch.equal(visibility(mask, True, query_len, key_len, query_start).expand_as(expected), expected)


@pytest.mark.parametrize("lengths", [[7, 7], [7, 5]])
def test_a_decoding_step_gives_its_key_padding_or_nothing(lengths):
    key_padding = padding(lengths, 7, left=True)
    for hf in hf_masks(key_padding, 1, 6, causal=True):
        mask, is_causal = relbias_mask_from_hf(hf, is_causal=True, query_start=6)
        assert is_causal
        if lengths == [7, 7]:
            assert mask is None
        else:
            assert torch.equal(mask, key_padding[:, None, None, :])


def test_static_cache_tail_is_left_to_the_causal_rule():
    # 4 tokens cached, 2 new queries at positions 4, 5, a cache of 10 slots: slots 6..9 are empty.
    key_padding = torch.ones(2, 10, dtype=torch.bool)
    bool_mask, _ = hf_masks(key_padding, 2, 4, causal=True)
    mask, is_causal = relbias_mask_from_hf(bool_mask, is_causal=True, query_start=4)
    assert mask is None and is_causal


def test_a_tensor_query_start_is_read_in_eager_mode():
    # a static cache's past_seen_tokens is a 0-dim int64 tensor
    key_padding = padding([10, 8], 10, left=True)
    bool_mask, _ = hf_masks(key_padding, 2, 4, causal=True)
    got = relbias_mask_from_hf(bool_mask, is_causal=True, query_start=torch.tensor(4))
    want = relbias_mask_from_hf(bool_mask, is_causal=True, query_start=4)
    assert got[1] == want[1] is True and torch.equal(got[0], want[0])


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_conversion_passes_the_mask_whole(causal):
    """Under torch.compile the form of a mask is not decided from its values: the exact mask goes on whole (bool as
    it is, float with -inf where transformers writes finfo.min), without is_causal, in one graph for every mask."""
    torch._dynamo.reset()
    convert = torch.compile(
        lambda mask, query_start: relbias_mask_from_hf(mask, is_causal=causal, query_start=query_start),
        fullgraph=True, backend="eager",
    )
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    for query_start, lengths in ((4, [10, 8]), (6, [10, 10]), (9, [10, 3])):
        query_len = 1 if causal else 10
        for hf in hf_masks(padding(lengths, 10, left=causal), query_len, query_start if causal else 0, causal):
            mask, is_causal = convert(hf, torch.tensor(query_start))
            assert is_causal is False and mask.shape == hf.shape
            if hf.dtype == torch.bool:
                assert torch.equal(mask, hf)
            else:
                assert mask.dtype == hf.dtype and torch.equal(mask == float("-inf"), hf != 0)
                assert torch.equal(mask.masked_fill(hf != 0, 0.0), torch.zeros_like(hf))
    assert counters["stats"]["unique_graphs"] - before <= 2  # at most one graph per dtype, not one per position
    torch._dynamo.reset()


def test_no_padding_gives_no_mask():
    full = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    assert relbias_mask_from_hf(full, is_causal=False) == (None, False)
    assert relbias_mask_from_hf(None, is_causal=True) == (None, True)
    causal = torch.tril(full)
    assert relbias_mask_from_hf(causal, is_causal=True) == (None, True)
    zeros = torch.zeros(2, 1, 5, 5)
    assert relbias_mask_from_hf(zeros, is_causal=False) == (None, False)


def test_irregular_masks_are_passed_whole():
    # A block-diagonal (packed sequences) mask is not key padding: passed exactly, without is_causal.
    block = torch.block_diag(torch.ones(3, 3), torch.ones(2, 2)).bool()[None, None].expand(2, 1, 5, 5)
    for is_causal in (False, True):
        hf = block if not is_causal else block & torch.tril(torch.ones(5, 5, dtype=torch.bool))
        mask, causal_out = relbias_mask_from_hf(hf, is_causal=is_causal)
        assert not causal_out and torch.equal(mask, hf)


def test_float_mask_with_other_values_stays_additive():
    hf = torch.zeros(1, 1, 2, 3)
    hf[..., 0, 2] = torch.finfo(torch.float32).min
    hf[..., 1, 0] = -0.5
    mask, is_causal = relbias_mask_from_hf(hf, is_causal=False)
    assert not is_causal and mask[0, 0, 0, 2] == float("-inf") and mask[0, 0, 1, 0] == -0.5 and mask[0, 0, 1, 2] == 0


def test_errors():
    with pytest.raises(TypeError, match="sdpa"):
        relbias_mask_from_hf(object(), is_causal=False)
    with pytest.raises(ValueError, match="4D"):
        relbias_mask_from_hf(torch.ones(2, 5, dtype=torch.bool), is_causal=False)
    with pytest.raises(TypeError, match="bool or float"):
        relbias_mask_from_hf(torch.ones(1, 1, 2, 2, dtype=torch.long), is_causal=False)
