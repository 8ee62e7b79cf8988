"""FIRE (Li et al. 2023, §3): hand-computed bias, query-position dependence, gradients, errors."""

import math

import pytest
import torch

from relbias import FIREBias
from relbias.biases import make_bias


def _mlp_by_hand(bias: FIREBias, x: float) -> list[float]:
    """f_theta(x) = W2 relu(W1 x + b1) + b2, one value per head, in plain Python floats."""
    first, second = bias.mlp[0], bias.mlp[2]
    hidden = [max(0.0, w * x + b) for w, b in zip(first.weight[:, 0].tolist(), first.bias.tolist())]
    return [sum(w * h for w, h in zip(row, hidden)) + b for row, b in zip(second.weight.tolist(), second.bias.tolist())]


def _fire_by_hand(bias: FIREBias, i: int, j: int, c: float, threshold: float) -> list[float]:
    d = i - j
    if d < 0 and not bias.bidirectional:
        return [0.0] * bias.num_heads
    psi = lambda x: math.log(c * x + 1)  # noqa: E731
    x = math.copysign(psi(abs(d)), d) / (psi(max(threshold, i)) + bias.eps) if d else 0.0
    return _mlp_by_hand(bias, x)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_bias_matches_hand_computation_below_and_above_the_threshold(bidirectional):
    bias = FIREBias(3, bidirectional=bidirectional, hidden_width=5, init_c=0.3, init_threshold=4.5)
    out = bias(3, 9, query_start=2).detach()  # queries at 2, 3, 4 (below L) and keys 0..8
    out2 = bias(2, 9, query_start=7).detach()  # queries at 7, 8 (above L: normalised by psi(i))
    for block, start in ((out, 2), (out2, 7)):
        for t in range(block.shape[1]):
            for s in range(9):
                expected = _fire_by_hand(bias, start + t, s, c=0.3, threshold=4.5)
                assert block[:, t, s].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_depends_on_the_query_position_beyond_the_threshold_only():
    bias = FIREBias(2, init_threshold=6.0, bidirectional=False)
    x = bias.normalized_input(torch.tensor([2, 5, 9, 12]), torch.tensor([1, 4, 8, 11]))
    assert x[0, 0] == x[1, 1]  # offset 1, queries 2 and 5 <= L: same normaliser psi(L)
    assert x[2, 2] > x[3, 3]  # offset 1, queries 9 < 12 past L: larger normaliser, smaller input
    inputs = bias.normalized_input(torch.arange(50, 60), torch.arange(0, 60)).detach()
    assert float(inputs.max()) <= 1.0 and float(inputs.min()) >= 0.0  # progressive interpolation


def test_native_form_is_refused_and_forward_uses_absolute_positions():
    bias = FIREBias(2)
    assert bias.offset_only is False
    with pytest.raises(NotImplementedError, match="absolute positions"):
        bias.native(4, 4)
    full = bias(6, 6)
    # default alignment: queries at the last keys (an ulp apart: the MLP runs on batches of another size)
    torch.testing.assert_close(bias(2, 6), full[:, 4:], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gradients_of_mlp_c_and_threshold_match_finite_differences(bidirectional, bias_gradcheck):
    # Threshold 2.5 lies between positions, so queries on both sides of it (max(L, i) is smooth there).
    bias = FIREBias(2, bidirectional=bidirectional, hidden_width=3, init_c=0.5, init_threshold=2.5).double()
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64) for _ in range(3))
    names, fn, params = bias_gradcheck(bias, q, k, v, is_causal=not bidirectional)
    assert {"bias.log_c", "bias.log_threshold"} <= set(names)
    fn(*params).sum().backward()
    grads = dict(zip(names, (p.grad for p in params)))
    assert grads["bias.log_threshold"].abs() > 0 and grads["bias.log_c"].abs() > 0  # both really learn


def test_parameter_count_and_pairs_sharing():
    bias = FIREBias(4, hidden_width=8, init_threshold=3.5)
    assert bias.num_parameters == 2 * 8 + 8 * 4 + 4 + 2 == sum(p.numel() for p in bias.parameters())
    # offset 2: queries 2 and 3 sit below L = 3.5 and share the normaliser; 4, 5 ... each have their own.
    assert bias.pairs_sharing(3, 1, 8).tolist() == [[2, 0], [3, 1]]
    assert bias.pairs_sharing(6, 4, 8).tolist() == [[6, 4]]


@torch.no_grad()
def test_registry_builds_fire_with_options():
    bias = make_bias("fire", num_heads=3, max_len=64, bidirectional=False, hidden_width=4, init_threshold=64.0)
    assert isinstance(bias, FIREBias) and bias.mlp[0].out_features == 4
    assert float(bias.threshold) == pytest.approx(64.0)
    assert float(FIREBias(1).c) == pytest.approx(0.1) and float(FIREBias(1).threshold) == pytest.approx(512.0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_heads": 0}, ValueError, "num_heads must be >= 1, got 0"),
        ({"num_heads": 2, "hidden_width": 0}, ValueError, "hidden_width must be >= 1, got 0"),
        ({"num_heads": 2, "hidden_width": 2.5}, TypeError, "hidden_width must be an int"),
        ({"num_heads": 2, "init_c": 0.0}, ValueError, "init_c must be a positive finite number, got 0.0"),
        ({"num_heads": 2, "init_threshold": -8}, ValueError, "init_threshold must be a positive finite number"),
        ({"num_heads": 2, "init_threshold": float("inf")}, ValueError, "init_threshold must be a positive finite"),
        ({"num_heads": 2, "eps": -1e-6}, ValueError, "eps must be a finite number >= 0"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs, error, message):
    num_heads = kwargs.pop("num_heads")
    with pytest.raises(error, match=message):
        FIREBias(num_heads, **kwargs)


def test_bad_positions_raise_clear_errors():
    bias = FIREBias(1)
    with pytest.raises(TypeError, match="integer tensor"):
        bias.pair_values(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must be 1-D"):
        bias.pair_values(torch.tensor([[0, 1]]), torch.tensor([0, 1]))
