"""ALiBi (Press et al. 2022, §3): golden slopes, hand-computed bias, sign, backends, errors."""

import math

import pytest
import torch

import relbias
from relbias import ALiBiBias, alibi_slopes
from relbias.biases import make_bias


def test_golden_slopes_8_heads_are_one_half_to_one_over_256():
    assert alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


def test_golden_slopes_6_heads_follow_the_reference_interleaving():
    assert alibi_slopes(6).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]


def test_golden_slopes_12_heads_by_hand():
    # 8 heads: 2^-1 .. 2^-8; then every other slope of 16 heads (2^-0.5, 2^-1, ..., 2^-8): the 1st,
    # 3rd, 5th and 7th, i.e. 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
    expected = [2.0**-k for k in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    assert alibi_slopes(12).tolist() == pytest.approx(expected, rel=1e-15)


def test_golden_slopes_small_head_counts():
    assert alibi_slopes(1).tolist() == [2.0**-8]
    assert alibi_slopes(2).tolist() == [2.0**-4, 2.0**-8]
    assert alibi_slopes(3).tolist() == [2.0**-4, 2.0**-8, 2.0**-2]


def test_causal_bias_is_minus_slope_times_distance_by_hand():
    bias = ALiBiBias(4, bidirectional=False)  # slopes 1/4, 1/16, 1/64, 1/256
    out = bias(3, 5)  # queries at 2, 3, 4
    for h, m in enumerate([1 / 4, 1 / 16, 1 / 64, 1 / 256]):
        for t in range(3):
            for s in range(5):
                i = t + 2
                expected = -m * (i - s) if i >= s else 0.0
                assert out[h, t, s].item() == pytest.approx(expected, abs=1e-7)


def test_bidirectional_bias_is_symmetric_in_distance():
    bias = ALiBiBias(2, bidirectional=True)
    out = bias(4, 4)
    slopes = [1 / 16, 1 / 256]
    for h in range(2):
        expected = torch.tensor([[-slopes[h] * abs(i - j) for j in range(4)] for i in range(4)])
        assert torch.allclose(out[h], expected, atol=0)
    native = bias.native(2, 6, query_start=3)  # offsets -2 .. 4
    assert torch.allclose(native.values[0], torch.tensor([-2.0, -1, 0, -1, -2, -3, -4]) / 16)


def test_attention_to_past_keys_decays_by_exp_minus_slope_per_token():
    # Equal q . k for every key (query of zeros): the weights are softmax(-m * distance).
    heads, length = 4, 6
    q = torch.zeros(1, heads, length, 8)
    k = torch.randn(1, heads, length, 8)
    v = torch.eye(length).expand(1, heads, length, length)  # output row = attention weights
    weights = relbias.attention(q, k, v, bias=ALiBiBias(heads), is_causal=True)[0, :, -1]  # last query
    for h, m in enumerate(alibi_slopes(heads).tolist()):
        row = weights[h]  # keys 0 .. 5, distances 5 .. 0
        assert torch.all(row[1:] > row[:-1])  # nearer keys weigh more
        ratios = row[:-1] / row[1:]
        assert torch.allclose(ratios, torch.full_like(ratios, math.exp(-m)), rtol=1e-5)


def test_no_learnable_parameters_and_slopes_not_in_state_dict():
    bias = ALiBiBias(8, bidirectional=False)
    assert bias.num_parameters == 0 and list(bias.parameters()) == []
    assert bias.state_dict() == {}
    assert bias.default_convention == "additive"


def test_causal_bias_refuses_visible_future_keys():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="causal"):
        relbias.attention(q, q, q, bias=ALiBiBias(2, bidirectional=False), is_causal=False)


def test_pairs_sharing_a_value_mirror_in_bidirectional_mode():
    assert ALiBiBias(1, bidirectional=True).pairs_sharing(1, 3, 4).tolist() == [[0, 2], [1, 3], [2, 0], [3, 1]]
    assert ALiBiBias(1, bidirectional=False).pairs_sharing(3, 1, 4).tolist() == [[2, 0], [3, 1]]


def test_registry_builds_alibi():
    bias = make_bias("alibi", num_heads=6, max_len=16, bidirectional=True)
    assert isinstance(bias, ALiBiBias) and bias.bidirectional
    assert torch.equal(bias.slopes, alibi_slopes(6).float())


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_heads": 0}, ValueError, "num_heads must be >= 1, got 0"),
        ({"num_heads": 2.0}, TypeError, "num_heads must be an int"),
        ({"num_heads": True}, TypeError, "num_heads must be an int"),
        ({"num_heads": 2, "bidirectional": 1}, TypeError, "bidirectional must be a bool"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs, error, message):
    num_heads = kwargs.pop("num_heads")
    with pytest.raises(error, match=message):
        ALiBiBias(num_heads, **kwargs)
    if "bidirectional" not in kwargs:
        with pytest.raises(error, match=message):
            alibi_slopes(num_heads)


def test_golden_mpt_slopes_by_hand():
    """MPT's rule: 2^(-alibi_bias_max * k / P), P the power of two >= H; even-numbered then odd-numbered."""
    assert relbias.mpt_alibi_slopes(4, 16.0).tolist() == [2.0**-4, 2.0**-8, 2.0**-12, 2.0**-16]
    # 3 heads, P = 4, max 8: 2^-2, 2^-4, 2^-6, 2^-8 -> even-numbered (2^-4, 2^-8) then odd-numbered (2^-2)
    assert relbias.mpt_alibi_slopes(3).tolist() == [2.0**-4, 2.0**-8, 2.0**-2]


@pytest.mark.parametrize("num_heads", [1, 3, 5, 6, 8, 12, 20, 32])
def test_mpt_slopes_with_max_8_are_the_papers(num_heads):
    assert torch.allclose(relbias.mpt_alibi_slopes(num_heads).double(), alibi_slopes(num_heads), rtol=1e-6, atol=0)


@pytest.mark.parametrize("value, error, message", [
    (0.0, ValueError, "alibi_bias_max must be finite and > 0, got 0.0"),
    (float("inf"), ValueError, "alibi_bias_max must be finite"),
    ("8", TypeError, "alibi_bias_max must be a real number"),
    (True, TypeError, "alibi_bias_max must be a real number"),
])
def test_mpt_slopes_bad_max_raises(value, error, message):
    with pytest.raises(error, match=message):
        relbias.mpt_alibi_slopes(4, value)


def test_explicit_slopes_set_each_heads_penalty():
    bias = ALiBiBias(3, bidirectional=False, slopes=[0.5, 0.125, 0.0])
    values = bias(4, 4)  # (H, Lq, Lk)
    offsets = torch.arange(4)[:, None] - torch.arange(4)[None, :]
    for head, slope in enumerate([0.5, 0.125, 0.0]):
        assert torch.equal(values[head], -slope * offsets.clamp(min=0).float())
    assert torch.equal(ALiBiBias(6, slopes=alibi_slopes(6)).slopes, ALiBiBias(6).slopes)
    assert "slopes" not in ALiBiBias(2, slopes=torch.tensor([1.0, 2.0])).state_dict()


def test_explicit_slopes_are_copied_not_aliased():
    given = torch.tensor([0.5, 0.25])
    bias = ALiBiBias(2, slopes=given)
    given.mul_(2)
    assert bias.slopes.tolist() == [0.5, 0.25]


@pytest.mark.parametrize("slopes, error, message", [
    ([0.5], ValueError, r"slopes must have shape \(2,\) \(one per head\), got \(1,\)"),
    (torch.ones(2, 1), ValueError, r"slopes must have shape \(2,\)"),
    ([0.5, -0.1], ValueError, r"slopes must be finite and >= 0; slopes\[1\] = -0.1"),
    (torch.tensor([float("nan"), 1.0]), ValueError, r"slopes\[0\] = nan"),
    (torch.tensor([1, 2]), TypeError, "slopes must be a floating-point tensor, got dtype torch.int64"),
    ("ab", TypeError, "slopes must be a float tensor or a sequence of real numbers"),
    ([0.5, True], TypeError, "slopes must be a float tensor or a sequence of real numbers"),
])
def test_bad_slopes_raise_clear_errors(slopes, error, message):
    with pytest.raises(error, match=message):
        ALiBiBias(2, slopes=slopes)
