"""Loading T5-family bias tables into relbias.T5Bias: agreement with transformers' own compute_bias."""

import pytest
import torch

from relbias import T5Bias
from relbias.integrations import (
    T5Biases,
    t5_biases_from_model,
    t5_biases_from_safetensors,
    t5_biases_from_state_dict,
)

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (the 'hf' extra)")


def hf_bias(attention, query_len, key_len, past=0):
    """transformers' (H, Lq, Lk) bias of a layer that owns a table."""
    with torch.no_grad():
        return attention.compute_bias(query_len, key_len, past_seen_tokens=past)[0]


def self_attention(model, stack, layer):
    return getattr(model, stack).block[layer].layer[0].SelfAttention


@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_from_model_matches_compute_bias(family, hf):
    model = hf.tiny_model(family)
    biases = t5_biases_from_model(model)
    assert len(biases.encoder) == len(biases.decoder) == 2
    assert biases.shared("encoder") == biases.shared("decoder") == (family != "umt5")
    for stack, bidirectional in (("encoder", True), ("decoder", False)):
        for layer, bias in enumerate(biases.stack(stack)):
            owner = self_attention(model, stack, layer if family == "umt5" else 0)
            assert isinstance(bias, T5Bias) and bias.bidirectional is bidirectional
            assert (bias.num_heads, bias.num_buckets, bias.max_distance) == (4, 8, 16)
            # Full block, then a decoding step after 37 cached tokens (queries at 37..39, keys 0..39).
            torch.testing.assert_close(bias(40, 40).detach(), hf_bias(owner, 40, 40), rtol=0, atol=0)
            torch.testing.assert_close(
                bias(3, 40, query_start=37).detach(), hf_bias(owner, 3, 40, past=37), rtol=0, atol=0
            )


def test_umt5_layers_differ_and_t5_layers_share(hf):
    umt5 = t5_biases_from_model(hf.tiny_model("umt5"))
    assert not torch.equal(umt5.encoder[0].weight, umt5.encoder[1].weight)
    t5 = t5_biases_from_model(hf.tiny_model("t5"))
    assert t5.encoder[0] is t5.encoder[1] and t5.encoder[0] is not t5.decoder[0]


def test_encoder_model_has_no_decoder_biases(hf):
    biases = t5_biases_from_model(hf.tiny_model("t5", "EncoderModel"))
    assert len(biases.encoder) == 2 and biases.decoder == ()


def test_share_weights_or_copy(hf):
    model = hf.tiny_model("t5")
    table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    shared = t5_biases_from_model(model, share_weights=True)
    copied = t5_biases_from_model(model)
    assert shared.encoder[0].weight is table
    assert copied.encoder[0].weight is not table and torch.equal(copied.encoder[0].weight, table)
    with torch.no_grad():
        table.add_(1.0)
    assert torch.equal(shared.encoder[0].weight, table) and not torch.equal(copied.encoder[0].weight, table)


def test_loading_keeps_the_random_stream(hf):
    model = hf.tiny_model("t5")
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    t5_biases_from_model(model)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_state_dict_and_safetensors_match_model(family, tmp_path, hf):
    model = hf.tiny_model(family)
    from_model = t5_biases_from_model(model)
    state = {key: value.detach().clone().contiguous() for key, value in model.state_dict().items()}
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(path))
    for loaded in (t5_biases_from_state_dict(state, max_distance=16), t5_biases_from_safetensors(path, max_distance=16)):
        assert isinstance(loaded, T5Biases)
        for stack in ("encoder", "decoder"):
            assert len(loaded.stack(stack)) == 2 and loaded.shared(stack) == from_model.shared(stack)
            for got, want in zip(loaded.stack(stack), from_model.stack(stack)):
                assert torch.equal(got.weight, want.weight) and got.bidirectional == want.bidirectional
                assert got.max_distance == 16


def test_state_dict_with_prefix_and_unused_cross_attention_table():
    table = torch.randn(32, 6)
    state = {
        "model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": table,
        "model.encoder.block.0.layer.1.DenseReluDense.wi.weight": torch.zeros(1),
        "model.encoder.block.5.layer.1.DenseReluDense.wi.weight": torch.zeros(1),
        "model.decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": table * 2,
        "model.decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": table * 3,
        "model.decoder.block.2.layer.2.DenseReluDense.wi.weight": torch.zeros(1),
    }
    biases = t5_biases_from_state_dict(state)
    assert len(biases.encoder) == 6 and len(biases.decoder) == 3
    assert torch.equal(biases.decoder[2].weight, table * 2) and biases.decoder[0].max_distance == 128
    assert not biases.decoder[0].bidirectional and biases.encoder[0].bidirectional


def test_state_dict_errors():
    table = torch.randn(8, 4)
    key = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
    with pytest.raises(ValueError, match="no T5 relative position table"):
        t5_biases_from_state_dict({"shared.weight": table})
    with pytest.raises(ValueError, match="layer 0 only"):
        t5_biases_from_state_dict({key.format(0): table, key.format(2): table, "encoder.block.3.x": table}, max_distance=16)
    with pytest.raises(ValueError, match="several prefixes"):
        t5_biases_from_state_dict({key.format(0): table, "a." + key.format(0): table}, max_distance=16)
    with pytest.raises(ValueError, match="different shapes"):
        t5_biases_from_state_dict({key.format(0): table, key.format(1): torch.randn(8, 2)}, max_distance=16)
    with pytest.raises(ValueError, match="num_buckets, num_heads"):
        t5_biases_from_state_dict({key.format(0): torch.randn(8)}, max_distance=16)
    with pytest.raises(ValueError, match="max_distance"):
        t5_biases_from_state_dict({key.format(0): table}, max_distance=2)


def test_safetensors_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors file"):
        t5_biases_from_safetensors(tmp_path / "absent.safetensors")


def test_from_model_rejects_other_models():
    with pytest.raises(TypeError, match="no T5-family encoder or decoder"):
        t5_biases_from_model(torch.nn.Linear(2, 2))
