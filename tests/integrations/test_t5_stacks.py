"""patch_t5 on any module whose attention lives in T5-family stacks: a T5 model inside a task head or a wrapper,
and a wrapper holding ``T5Stack`` s directly (as forecasting models such as Chronos-Bolt do); refusals name the
attention class that does not fit."""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from relbias.integrations import t5_attention as integration  # noqa: E402
from relbias.integrations.common import check_transformers_version as _check_version  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, is_patched, patch_t5, unpatch_t5  # noqa: E402

from .._tolerance import assert_rounding_close  # noqa: E402

try:
    _check_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)


class Forecaster(nn.Module):
    """A user's model built on T5 stacks, not on a transformers model class: patch embeddings in, a head out."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.t5.modeling_t5 import T5Stack

        self.embed = nn.Linear(3, config.d_model)
        encoder_config, decoder_config = copy.deepcopy(config), copy.deepcopy(config)
        encoder_config.is_decoder, encoder_config.use_cache = False, False
        decoder_config.is_decoder, decoder_config.is_encoder_decoder = True, False
        self.encoder, self.decoder = T5Stack(encoder_config), T5Stack(decoder_config)
        self.head = nn.Linear(config.d_model, 3)

    def forward(self, series, horizon):
        memory = self.encoder(inputs_embeds=self.embed(series)).last_hidden_state
        out = self.decoder(inputs_embeds=self.embed(horizon), encoder_hidden_states=memory).last_hidden_state
        return self.head(out)


class Holder(nn.Module):
    """A wrapper around a whole transformers T5 model."""

    def __init__(self, model):
        super().__init__()
        self.backbone = model

    def forward(self, input_ids):
        return self.backbone(input_ids=input_ids).last_hidden_state


def _forecasters(hf):
    torch.manual_seed(0)
    plain = Forecaster(hf.tiny_config("t5")).eval()
    for stack in (plain.encoder, plain.decoder):
        with torch.no_grad():
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(10.0)
    return patch_t5(copy.deepcopy(plain)), plain


def test_a_wrapper_of_t5_stacks_gives_the_unpatched_outputs_and_unpatches(hf, monkeypatch):
    patched, plain = _forecasters(hf)
    calls = []
    real = integration.attention
    monkeypatch.setattr(integration, "attention", lambda *a, **k: calls.append(k["is_causal"]) or real(*a, **k))
    series, horizon = torch.randn(2, 40, 3), torch.randn(2, 12, 3)
    with torch.no_grad():
        got, want = patched(series, horizon), plain(series, horizon)
    assert_rounding_close(got, want, n=64)
    assert sorted(set(calls)) == [False, True] and len(calls) == 4  # 2 encoder layers, 2 causal decoder layers
    assert is_patched(patched)
    unpatch_t5(patched)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(patched(series, horizon), want)  # transformers' own code again: the same path
    assert calls == []


def test_a_wrapper_of_t5_stacks_trains_like_the_unpatched_one(hf):
    patched, plain = _forecasters(hf)
    series, horizon = torch.randn(2, 40, 3), torch.randn(2, 12, 3)
    grads = []
    for model in (patched, plain):
        model.zero_grad()
        model(series, horizon).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        assert_rounding_close(grads[0][name], grads[1][name], n=64 * 40)


@pytest.mark.parametrize("kind", ["ForSequenceClassification", "EncoderModel"])
def test_a_t5_model_inside_a_head_or_a_wrapper(hf, kind):
    plain = hf.tiny_model("t5", kind)
    patched = patch_t5(Holder(copy.deepcopy(plain)) if kind == "EncoderModel" else copy.deepcopy(plain))
    input_ids, _ = hf.batch(length=30)
    input_ids[:, -1] = 1  # an end-of-sequence token: the classification head reads it
    with torch.no_grad():
        got = patched(input_ids)
        want = plain(input_ids)
    got = got if isinstance(got, torch.Tensor) else got.logits
    want = want.last_hidden_state if kind == "EncoderModel" else want.logits
    assert_rounding_close(got, want, n=64)


def test_stacks_with_another_attention_are_refused_by_name(hf):
    transformers = hf.transformers
    config = transformers.LongT5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    with pytest.raises(TypeError, match="no T5-family stack in LongT5EncoderModel.*LongT5"):
        patch_t5(transformers.LongT5EncoderModel(config))


def test_chronos_bolt_forecasts_as_unpatched(hf, monkeypatch):
    """chronos-forecasting's Chronos-Bolt (T5 stacks behind patch embeddings and quantile heads), from a config."""
    bolt = pytest.importorskip("chronos.chronos_bolt", reason="chronos-forecasting is not installed")
    config = hf.tiny_config(
        "t5", dense_act_fn="relu", feed_forward_proj="relu",
        chronos_config=dict(context_length=64, prediction_length=8, input_patch_size=4, input_patch_stride=4,
                            quantiles=[0.1, 0.5, 0.9], use_reg_token=True),
    )
    torch.manual_seed(0)
    plain = bolt.ChronosBoltModelForForecasting(config).eval()
    patched = patch_t5(copy.deepcopy(plain))
    calls = []
    real = integration.attention
    monkeypatch.setattr(integration, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    context = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).cumsum(-1)
    context[0, :10] = float("nan")  # missing values: Chronos-Bolt masks them
    with torch.no_grad():
        got, want = patched(context).quantile_preds, plain(context).quantile_preds
    assert got.shape == (3, 3, 8) and len(calls) == 4
    assert_rounding_close(got, want, n=64)
