"""KERPLE (Chi et al. 2022, §4): hand-computed kernels, positivity, initialisation, gradients, errors."""

import math

import pytest
import torch

import relbias
from relbias import KerpleLogBias, KerplePowerBias
from relbias.biases import make_bias


def test_log_variant_matches_hand_computation():
    bias = KerpleLogBias(2, init_r1=[0.5, 1.5], init_r2=[0.25, 2.0], bidirectional=False)
    out = bias(3, 4).detach()  # queries at 1, 2, 3; keys 0..3
    for h, (r1, r2) in enumerate([(0.5, 0.25), (1.5, 2.0)]):
        for t in range(3):
            for s in range(4):
                d = t + 1 - s
                expected = -r1 * math.log(1 + r2 * d) if d >= 0 else 0.0
                assert out[h, t, s].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_power_variant_matches_hand_computation_in_both_directions():
    bias = KerplePowerBias(2, bidirectional=True, init_r1=[0.5, 1.5], init_r2=[0.5, 1.75])
    out = bias(4, 4).detach()
    for h, (r1, r2) in enumerate([(0.5, 0.5), (1.5, 1.75)]):
        expected = torch.tensor([[-r1 * abs(i - j) ** r2 for j in range(4)] for i in range(4)])
        assert torch.allclose(out[h], expected, rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_parameters_stay_positive_whatever_the_raw_values():
    for cls in (KerpleLogBias, KerplePowerBias):
        bias = cls(3)
        bias.raw_r1.copy_(torch.tensor([-50.0, 0.0, 50.0]))
        bias.raw_r2.copy_(torch.tensor([-50.0, 0.0, 50.0]))
        assert bool((bias.r1 > 0).all()) and bool((bias.r2 > 0).all())
    assert float(bias.r2.max()) <= 2.0  # power exponent stays in (0, 2]


@torch.no_grad()
def test_default_initialisation_draws_the_documented_ranges():
    log = KerpleLogBias(64)
    assert 0.01 <= float(log.r1.min()) and float(log.r1.max()) <= 1.99 + 1e-6
    assert 0.01 <= float(log.r2.min()) and float(log.r2.max()) <= 0.99 + 1e-6
    power = KerplePowerBias(64)
    assert 0.01 <= float(power.r1.min()) and float(power.r1.max()) <= 0.99 + 1e-6
    assert 0.01 <= float(power.r2.min()) and float(power.r2.max()) <= 1.99 + 1e-6
    assert log.num_parameters == 128 == sum(p.numel() for p in log.parameters())


@pytest.mark.parametrize("cls", [KerpleLogBias, KerplePowerBias])
def test_attention_to_past_keys_decays_with_distance(cls):
    heads, length = 3, 8
    q = torch.zeros(1, heads, length, 4)  # equal q . k for every key
    k = torch.randn(1, heads, length, 4)
    v = torch.eye(length).expand(1, heads, length, length)
    weights = relbias.attention(q, k, v, bias=cls(heads), is_causal=True)[0, :, -1]  # (H, keys)
    assert bool((weights[:, 1:] > weights[:, :-1]).all())


@pytest.mark.parametrize("cls", [KerpleLogBias, KerplePowerBias])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_gradients_match_finite_differences(cls, bidirectional, bias_gradcheck):
    bias = cls(2, bidirectional=bidirectional, init_r1=[0.7, 1.3], init_r2=[0.4, 1.2]).double()
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64) for _ in range(3))
    # query, key and value gradients are the core's tests; here the bias parameters
    names, _, _ = bias_gradcheck(bias, q, k, v, is_causal=not bidirectional)
    assert names == ["bias.raw_r1", "bias.raw_r2"]


def test_power_gradient_is_finite_at_distance_zero():
    bias = KerplePowerBias(1, init_r2=0.5)
    bias(3, 3).sum().backward()
    assert torch.isfinite(bias.raw_r1.grad).all() and torch.isfinite(bias.raw_r2.grad).all()


@pytest.mark.parametrize("name, cls", [("kerple_log", KerpleLogBias), ("kerple_power", KerplePowerBias)])
def test_registry_builds_kerple_with_options(name, cls):
    bias = make_bias(name, num_heads=2, max_len=8, bidirectional=False, init_r1=1.0, init_r2=0.5)
    assert isinstance(bias, cls) and not bias.bidirectional
    assert torch.allclose(bias.r1, torch.ones(2)) and torch.allclose(bias.r2, torch.full((2,), 0.5))


@pytest.mark.parametrize(
    "cls, kwargs, error, message",
    [
        (KerpleLogBias, {"num_heads": 0}, ValueError, "num_heads must be >= 1, got 0"),
        (KerpleLogBias, {"num_heads": "2"}, TypeError, "num_heads must be an int"),
        (KerpleLogBias, {"num_heads": 2, "init_r1": 0.0}, ValueError, r"init_r1 must be > 0 and finite, got 0.0"),
        (KerpleLogBias, {"num_heads": 2, "init_r2": -1.0}, ValueError, r"init_r2 must be > 0 and finite"),
        (KerpleLogBias, {"num_heads": 2, "init_r1": float("nan")}, ValueError, "init_r1 must be > 0 and finite"),
        (KerplePowerBias, {"num_heads": 2, "init_r2": 2.0}, ValueError, r"init_r2 must be in \(0, 2\), got 2.0"),
        (KerplePowerBias, {"num_heads": 2, "init_r1": [1.0, 2.0, 3.0]}, ValueError, r"2 numbers \(one per head\)"),
        (KerplePowerBias, {"num_heads": 2, "bidirectional": "yes"}, TypeError, "bidirectional must be a bool"),
    ],
)
def test_bad_settings_raise_clear_errors(cls, kwargs, error, message):
    num_heads = kwargs.pop("num_heads")
    with pytest.raises(error, match=message):
        cls(num_heads, **kwargs)
