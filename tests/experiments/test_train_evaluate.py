"""Training lowers the loss reproducibly; evaluation against hand computations and golden values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from relbias.experiments import TrainConfig, check_reachable, evaluate_lengths, scored_bytes, train_model
from relbias.experiments import ByteLM, ByteLMConfig

TINY = dict(max_len=8, embed_dim=16, num_heads=2, num_layers=1)


def _tokens(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def test_training_learns_a_periodic_text_and_is_reproducible():
    tokens = _tokens("abcdefg" * 60)
    config = TrainConfig(steps=40, batch_size=8, lr=1e-2, warmup=5)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(train_model(ByteLM(ByteLMConfig(position="t5", **TINY)), tokens, config))
    assert runs[0] == runs[1]  # same seed, same batches, same numbers
    assert runs[0][-1] < 0.25 * runs[0][0]  # starts near ln 256 = 5.5 nats, must learn the cycle


def test_learning_rate_schedule():
    config = TrainConfig(steps=110, lr=1.0, warmup=10)
    assert config.lr_at(0) == pytest.approx(0.1) and config.lr_at(9) == pytest.approx(1.0)
    assert config.lr_at(10) == pytest.approx(1.0) and config.lr_at(110) == pytest.approx(0.1)
    assert config.lr_at(60) == pytest.approx(0.55)  # half-way down the cosine from 1 to 0.1


def test_a_uniform_model_scores_exactly_eight_bits_per_byte():
    model = ByteLM(ByteLMConfig(position="none", **TINY))
    with torch.no_grad():
        model.embed.weight.zero_()  # tied head: all logits 0, uniform over 256 bytes
    scores = evaluate_lengths(model, _tokens("hello world, " * 20), [4, 8])
    for n in (4, 8):
        assert scores[n]["bpb"] == pytest.approx(8.0)
        assert scores[n]["ppl"] == pytest.approx(256.0)
        assert scores[n]["nll"] == pytest.approx(math.log(256))


def test_evaluation_equals_a_window_by_window_computation():
    torch.manual_seed(3)
    model = ByteLM(ByteLMConfig(position="alibi" if "alibi" in __import__("relbias").biases.FAMILIES else "t5", **TINY))
    tokens = _tokens("The quick brown fox jumps over the lazy dog. " * 3)
    usable = scored_bytes(len(tokens), [4, 12])
    assert usable == (len(tokens) - 1) // 12 * 12
    scores = evaluate_lengths(model, tokens, [4, 12], batch_tokens=10)  # several batches per length
    for n in (4, 12):
        losses = []
        for start in range(0, usable, n):
            window = tokens[start : start + n + 1].long()
            with torch.no_grad():
                logits = model(window[None, :-1])[0]
            losses.append(F.cross_entropy(logits, window[1:], reduction="sum").item())
        assert scores[n]["nll"] == pytest.approx(sum(losses) / usable, rel=1e-5)
        assert scores[n]["tokens"] == usable


def test_too_little_held_out_text_is_reported():
    with pytest.raises(ValueError, match=r"held-out split has 20 bytes.*lcm = 24 \+ 1"):
        scored_bytes(20, [8, 12])


def test_unreachable_length_is_caught_before_training():
    strict = ByteLM(ByteLMConfig(position="offset", position_options={"out_of_range": "error"}, **TINY))
    check_reachable(strict, 8)
    with pytest.raises(ValueError, match=r"scheme 'offset' cannot be evaluated at length 16.*out_of_range='clip'"):
        check_reachable(strict, 16)
    clipped = ByteLM(ByteLMConfig(position="offset", position_options={"out_of_range": "clip"}, **TINY))
    check_reachable(clipped, 64)


def test_training_length_longer_than_the_split_is_an_error():
    model = ByteLM(ByteLMConfig(position="none", **TINY))
    with pytest.raises(ValueError, match="training split has 8 bytes, not more than the training length 8"):
        train_model(model, _tokens("abcdefgh"), TrainConfig(steps=1))
