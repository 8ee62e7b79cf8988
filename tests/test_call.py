"""relbias.call.AttentionCall: what backends read, including which keys' finiteness matters (only keys some
query cannot see: a fused kernel would spread their NaN/inf through 0 * NaN)."""

from __future__ import annotations

import pytest
import torch

from relbias.call import make_call


def _kv_with_nan_at(position, lk=12):
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, lk, 4), torch.randn(1, 2, lk, 4)
    v[0, 1, position] = float("nan")
    return q, k, v


@pytest.mark.parametrize("position, finite", [(0, True), (9, True), (10, False), (11, False)])
def test_causal_decode_reads_only_keys_after_the_first_query(position, finite):
    q, k, v = _kv_with_nan_at(position)  # queries at 9, 10, 11: keys 10, 11 are hidden from query 9
    assert make_call(q, k, v, is_causal=True).hidden_keys_finite is finite


@pytest.mark.parametrize("position", [0, 5, 11])
def test_bidirectional_without_mask_hides_nothing(position):
    assert make_call(*_kv_with_nan_at(position)).hidden_keys_finite is True


def test_a_key_padding_mask_hides_its_keys_and_a_query_mask_hides_per_query():
    q, k, v = _kv_with_nan_at(4)
    padding = torch.arange(12) != 4
    assert make_call(q, k, v, mask=padding).hidden_keys_finite is False
    assert make_call(q, k, v, mask=torch.arange(12) != 5).hidden_keys_finite is True
    per_query = torch.ones(3, 12, dtype=torch.bool)
    per_query[1, 4] = False  # hidden from query 1 only
    assert make_call(q, k, v, mask=per_query).hidden_keys_finite is False
    additive = torch.zeros(3, 12).masked_fill(~per_query, float("-inf"))
    assert make_call(q, k, v, mask=additive).hidden_keys_finite is False


def test_the_mask_is_made_4d_and_settings_are_resolved():
    q = torch.randn(2, 3, 5, 16)
    call = make_call(q, q, q, mask=torch.ones(5, dtype=torch.bool))
    assert call.mask.shape == (1, 1, 1, 5) and call.key_padding.shape == (1, 1, 5)
    assert call.convention == "seed" and call.scale == 0.25 and call.bias_scale == 0.25 and call.delta == 0


def test_the_finiteness_check_survives_a_sum_that_overflows_and_infinities_that_cancel():
    """hidden_keys_finite sums the hidden keys first (no temporaries); a non-finite sum is checked exactly."""
    q = torch.randn(1, 1, 2, 4)
    k = torch.full((1, 1, 6, 4), 3e38)  # finite, but its sum overflows to inf
    assert make_call(q, k, k.clone(), is_causal=True).hidden_keys_finite is True
    v = torch.zeros(1, 1, 6, 4)
    v[0, 0, 5, 0], v[0, 0, 5, 1] = float("inf"), float("-inf")  # a sum of NaN: exact scan says not finite
    assert make_call(q, torch.zeros(1, 1, 6, 4), v, is_causal=True).hidden_keys_finite is False
