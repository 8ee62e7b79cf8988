"""Windowed evaluation: attention limited to the training length, against an explicit band mask on the reference
backend and against sliding windows of stride 1; the whole text in one forward and in pieces; the window put back."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from relbias.experiments import ByteLM, ByteLMConfig, evaluate_lengths
from relbias.experiments.evaluate import attention_window, evaluate_whole_text, training_window, window_plan
from relbias.experiments.positional import RotaryByteLM, SinusoidalByteLM

TEXT = b"Attention limited to the training length sees at most L bytes at every layer, whatever the length. " * 2


def _tokens() -> torch.Tensor:
    return torch.tensor(list(TEXT), dtype=torch.uint8)


def _model(position: str, num_layers: int = 2, **options) -> ByteLM:
    torch.manual_seed(3)
    config = ByteLMConfig(position=position, position_options=options, max_len=8, embed_dim=16, num_heads=2,
                          num_layers=num_layers)
    if position in ("rotary", "sinusoidal"):
        return {"rotary": RotaryByteLM, "sinusoidal": SinusoidalByteLM}[position](config)
    return ByteLM(config)


class _BandMasked(nn.Module):
    """The layer called with an explicit (n, n) band mask of the causal window (left, 0), on the reference backend."""

    def __init__(self, layer: nn.Module, left: int) -> None:
        super().__init__()
        self.layer, self.left = layer, left
        layer.backend = "reference"

    def forward(self, query, key, value, **kwargs):
        offset = torch.arange(query.shape[1])[:, None] - torch.arange(query.shape[1])[None, :]  # (n, n) i - j
        hidden = (offset < 0) | (offset > self.left)  # torch's bool attn_mask: True = may NOT attend
        return self.layer(query, key, value, attn_mask=hidden, **kwargs)


def _reference_nll(model: ByteLM, tokens: torch.Tensor, usable: int, n: int, left: int) -> float:
    """Mean loss over non-overlapping windows of n bytes, each layer masked to the band 0 <= i - j <= left."""
    reference = copy.deepcopy(model)
    for block in reference.blocks:
        block.attn = _BandMasked(block.attn, left)
    total = 0.0
    with torch.no_grad():
        for start, _ in window_plan(usable, n):
            window = tokens[start : start + n + 1].long()
            logits = reference(window[None, :-1])[0]  # (n, 256)
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
    return total / usable


@pytest.mark.parametrize("position, options", [("offset", {"out_of_range": "clip"}), ("t5", {"num_buckets": 8, "max_distance": 16}),
                                               ("alibi", {}), ("none", {})])
def test_windowed_lengths_equal_an_explicit_band_mask_on_the_reference_backend(position, options):
    model, tokens = _model(position, **options), _tokens()
    window = training_window(8)
    assert window == (7, 0)
    scores = evaluate_lengths(model, tokens, [8, 16, 32], window=window, batch_tokens=64)
    full = evaluate_lengths(model, tokens, [8, 16, 32], batch_tokens=64)
    usable = scores[8]["tokens"]
    for n in (16, 32):
        assert scores[n]["nll"] == pytest.approx(_reference_nll(model, tokens, usable, n, 7), rel=1e-5)
        assert scores[n]["nll"] != pytest.approx(full[n]["nll"], rel=1e-6)  # the window removed keys
        assert scores[n]["windows"] == full[n]["windows"] and scores[n]["tokens"] == full[n]["tokens"]
    assert scores[8]["nll"] == pytest.approx(full[8]["nll"], rel=1e-5)  # at L the window hides nothing
    assert all(layer.attn.window is None for layer in model.blocks)  # put back


@pytest.mark.parametrize("position", ["offset", "alibi", "kerple_log", "fire", "none", "rotary"])
def test_whole_text_in_one_windowed_forward_is_sliding_with_stride_1_for_one_layer(position):
    # One layer: a query's output depends only on the window of L bytes ending at it, so one windowed forward over
    # the text scores every byte exactly as sliding windows of L bytes with stride 1 do.
    options = {"out_of_range": "clip"} if position == "offset" else {}
    model, tokens = _model(position, num_layers=1, **options), _tokens()
    whole = evaluate_whole_text(model, tokens, [8, 16], training_window(8))  # the bytes lengths 8 and 16 score
    sliding = evaluate_lengths(model, tokens[: whole["tokens"] + 1], [8], mode="sliding", stride=1)[8]
    assert whole["windows"] == 1 and sliding["tokens"] == whole["tokens"] == len(TEXT) - 1 - (len(TEXT) - 1) % 16
    assert whole["nll"] == pytest.approx(sliding["nll"], rel=1e-5)


@pytest.mark.parametrize("position", ["t5", "kerple_power", "rotary"])
def test_whole_text_in_pieces_equals_one_forward(position):
    # Two layers reach 2 (L - 1) bytes back: each piece is preceded by that much text, so its bytes score the same.
    model, tokens = _model(position), _tokens()
    one = evaluate_whole_text(model, tokens, [8], training_window(8))
    pieces = evaluate_whole_text(model, tokens, [8], training_window(8), max_tokens=9)
    assert one["windows"] == 1 and pieces["windows"] == -(-one["tokens"] // 9)
    assert pieces["nll"] == pytest.approx(one["nll"], rel=1e-5)
    usable = one["tokens"]
    assert one["nll"] == pytest.approx(evaluate_lengths(model, tokens, [usable], window=(7, 0))[usable]["nll"],
                                       rel=1e-5)  # the whole text as one window of the windowed evaluation


def test_rotary_and_sinusoidal_take_the_window_and_a_wide_one_changes_nothing():
    tokens = _tokens()
    for position in ("rotary", "sinusoidal"):
        model = _model(position)
        full = evaluate_lengths(model, tokens, [32])[32]["nll"]
        wide = evaluate_lengths(model, tokens, [32], window=(31, 0))[32]["nll"]  # sees every key: full attention
        narrow = evaluate_lengths(model, tokens, [32], window=(7, 0))[32]["nll"]
        assert wide == pytest.approx(full, rel=1e-5) and narrow != pytest.approx(full, rel=1e-6)


def test_the_window_is_put_back_and_errors_name_the_problem():
    model = _model("alibi")
    with pytest.raises(RuntimeError, match="inside"):
        with attention_window(model, (3, 0)):
            assert [block.attn.window for block in model.blocks] == [(3, 0), (3, 0)]
            raise RuntimeError("inside")
    assert [block.attn.window for block in model.blocks] == [None, None]
    with pytest.raises(TypeError, match="window left must be an int"):
        evaluate_lengths(model, _tokens(), [8], window=(7.0, 0))
    with pytest.raises(ValueError, match=r"causal window \(left, 0\)"):
        evaluate_whole_text(model, _tokens(), [8], (None, 0))
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        evaluate_whole_text(model, _tokens(), [8], (7, 0), max_tokens=0)
    with pytest.raises(ValueError, match="train_len must be an int >= 1"):
        training_window(0)
    model.blocks[0].attn = nn.Identity()
    with pytest.raises(TypeError, match=r"attention layer\(s\) \['Identity'\] take no window"):
        evaluate_lengths(model, _tokens(), [8], window=(7, 0))
