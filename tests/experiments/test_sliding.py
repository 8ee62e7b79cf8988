"""Evaluation windows: every target byte scored exactly once, sliding evaluation by hand, the window refusal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from relbias.experiments import ByteLM, ByteLMConfig, evaluate_lengths
from relbias.experiments.evaluate import check_windows, window_plan


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 200), st.data())
def test_every_byte_is_scored_exactly_once_with_its_context(length, stride, extra, data):
    stride = min(stride, length)
    usable = length + extra
    mode = data.draw(st.sampled_from(["sliding", "nonoverlapping"]))
    if mode == "nonoverlapping":
        usable = usable // length * length
    plan = window_plan(usable, length, mode, stride)
    counts = [0] * usable
    for w, (start, first) in enumerate(plan):
        assert 0 <= start and start + length <= usable and 0 <= first < length  # full windows inside the text
        for position in range(first, length):
            counts[start + position] += 1
            if mode == "sliding" and w > 0:
                assert position >= length - stride  # each later byte has at least n - S bytes of context
    assert counts == [1] * usable
    if mode == "sliding" and usable % length == 0:
        assert window_plan(usable, length, "sliding", length) == window_plan(usable, length)  # S = n: non-overlapping


def test_sliding_plan_by_hand_and_its_errors():
    # 10 bytes, windows of 4, stride 3: [0, 4) scores 0-3; [3, 7) scores 4-6; [6, 10) scores 7-9.
    assert window_plan(10, 4, "sliding", 3) == [(0, 0), (3, 1), (6, 1)]
    # 9 bytes: the last window [5, 9) scores only bytes 7-8, the ones not yet scored.
    assert window_plan(9, 4, "sliding", 3) == [(0, 0), (3, 1), (5, 2)]
    with pytest.raises(ValueError, match=r"stride in \[1, 4\] \(the window length\), got 5"):
        window_plan(12, 4, "sliding", 5)
    with pytest.raises(ValueError, match="unknown evaluation mode 'strided'"):
        window_plan(12, 4, "strided")


def test_sliding_evaluation_equals_a_byte_by_byte_computation():
    torch.manual_seed(4)
    model = ByteLM(ByteLMConfig(position="alibi", max_len=8, embed_dim=16, num_heads=2, num_layers=1))
    tokens = torch.tensor(list(b"sliding windows score every byte once, in context. " * 2), dtype=torch.uint8)
    scores = evaluate_lengths(model, tokens, [4, 8], mode="sliding", stride=3, batch_tokens=16)
    usable = scores[8]["tokens"]
    for n in (4, 8):
        total = 0.0
        for target in range(usable):  # the byte's window: the last n inputs ending at it, from the text's start
            if target < n:
                start = 0
            else:
                plan = window_plan(usable, n, "sliding", 3)
                start = next(s for s, f in plan if s + f <= target < s + n)
            window = tokens[start : start + n + 1].long()
            with torch.no_grad():
                logits = model(window[None, :-1])[0]
            total += F.cross_entropy(logits[target - start][None], window[target - start + 1][None]).item()
        assert scores[n]["nll"] == pytest.approx(total / usable, rel=1e-5)
    nonoverlapping = evaluate_lengths(model, tokens, [4, 8])
    assert scores[4]["nll"] != pytest.approx(nonoverlapping[4]["nll"], rel=1e-6)  # more context: other numbers
    assert scores[8]["windows"] > nonoverlapping[8]["windows"] == usable // 8


def test_a_length_the_held_out_text_cannot_fill_is_refused():
    check_windows(16 * 2048, [64, 2048], train_len=64, min_windows=16)
    with pytest.raises(ValueError, match=r"evaluation length 2048 \(32L\): the held-out text gives 7 window\(s\) of "
                                         r"2048 bytes \(14336 scored bytes\), at least 8 are needed"):
        check_windows(7 * 2048, [64, 128, 2048], train_len=64)
