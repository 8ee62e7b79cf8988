"""patch_t5 on the other transformers models whose self-attention is T5Attention: Switch Transformers, Pop2Piano.

Tiny models from configs with random weights (no downloads), patched against unpatched: forward logits with padded
masks, greedy generation. Models that use the T5 bias differently (LongT5's encoder, UDOP's encoder, Pix2Struct's
text decoder layout) must be refused with a TypeError rather than patched wrongly.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from relbias.integrations import t5_attention as integration  # noqa: E402
from relbias.integrations.common import check_transformers_version as _check_version  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, is_patched, patch_t5, unpatch_t5  # noqa: E402

from .._tolerance import assert_rounding_close  # noqa: E402

try:
    _check_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

#: The longest sum in the tiny models, as test_patch_t5: d_ff = 64 features (keys: at most 40).
N_SUM = 64
# family -> (class-name prefix, attention implementations the model accepts: Switch Transformers has no SDPA path)
FAMILIES = {
    "switch_transformers": ("SwitchTransformers", ("eager",)),
    "pop2piano": ("Pop2Piano", ("sdpa", "eager")),
}
CASES = [(family, impl) for family, (_, impls) in FAMILIES.items() for impl in impls]


def close(got, want):
    """Patched against unpatched (other attention kernels): equal to float32 rounding of the longest sum, scaled by
    the compared tensor's magnitude (tests/_tolerance.py)."""
    assert_rounding_close(got, want, n=N_SUM)


def tiny_config(hf, family, **overrides):
    """conftest's 2-layer, 4-head, d_model 32 T5 settings, in ``family``'s config class (Switch: 2 experts)."""
    settings = hf.tiny_config("t5").to_dict()
    keep = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
            "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate", "pad_token_id",
            "eos_token_id")
    settings = {key: settings[key] for key in keep}
    if family == "switch_transformers":  # one sparse (2-expert) layer per stack, capacity above any test's tokens
        settings.update(num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                        decoder_start_token_id=0)
        cls = hf.transformers.SwitchTransformersConfig
    else:
        settings.update(composer_vocab_size=2)
        cls = hf.transformers.Pop2PianoConfig
    settings.update(overrides)
    return cls(**settings)


def tiny_model(hf, family, kind="ForConditionalGeneration", attn_implementation="eager", bias_scale=10.0, **overrides):
    """Seeded, eval mode, bias tables scaled as conftest.tiny_model does (the bias then weighs as much as q.k)."""
    torch.manual_seed(0)
    cls = getattr(hf.transformers, FAMILIES[family][0] + kind)
    model = cls._from_config(tiny_config(hf, family, **overrides), attn_implementation=attn_implementation).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                parameter.mul_(bias_scale)
    if family == "pop2piano":  # generate() reads these from the generation config (a checkpoint ships them)
        model.generation_config.decoder_start_token_id = 0
        model.generation_config.composer_to_feature_token = {"composer1": 60, "composer2": 61}  # composer_vocab_size 2
    return model


def encoder_inputs(hf, family, length, pad_last):
    """Token ids (Switch) or (B, L, d_model) features (Pop2Piano's encoder reads input_features), and the mask."""
    input_ids, attention_mask = hf.batch(length=length, pad_last=pad_last)
    if family == "pop2piano":
        features = torch.randn(*input_ids.shape, 32, generator=torch.Generator().manual_seed(4))
        return dict(input_features=features, attention_mask=attention_mask)
    return dict(input_ids=input_ids, attention_mask=attention_mask)


@pytest.fixture
def spy(monkeypatch):
    """Counts the patched layers' relbias.attention calls (each then computes as usual)."""
    calls = []
    real = integration.attention

    def recording(query, key, value, **kwargs):
        calls.append((query.shape[2], key.shape[2]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(integration, "attention", recording)
    return calls


@pytest.mark.parametrize("family, attn_implementation", CASES)
def test_seq2seq_forward_with_padding(hf, spy, family, attn_implementation):
    patched = patch_t5(tiny_model(hf, family, attn_implementation=attn_implementation))
    plain = tiny_model(hf, family, attn_implementation=attn_implementation)
    decoder_input_ids, decoder_attention_mask = hf.batch(length=30, pad_last=7, seed=2)
    inputs = dict(encoder_inputs(hf, family, length=40, pad_last=9), decoder_input_ids=decoder_input_ids,
                  decoder_attention_mask=decoder_attention_mask, use_cache=False)
    with torch.no_grad():
        got, want = patched(**inputs), plain(**inputs)
    assert spy == [(40, 40)] * 2 + [(30, 30)] * 2  # every self-attention layer ran through relbias
    close(got.encoder_last_hidden_state, want.encoder_last_hidden_state)
    close(got.logits, want.logits)
    assert got.logits.abs().max() > 0.1  # not a degenerate all-zero comparison


def test_switch_encoder_model_with_padding(hf, spy):
    patched = patch_t5(tiny_model(hf, "switch_transformers", "EncoderModel"))
    plain = tiny_model(hf, "switch_transformers", "EncoderModel")
    input_ids, attention_mask = hf.batch(batch_size=3, length=40, pad_last=13)
    with torch.no_grad():
        got = patched(input_ids, attention_mask=attention_mask).last_hidden_state
        want = plain(input_ids, attention_mask=attention_mask).last_hidden_state
    assert len(spy) == 2
    close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_tokens(hf, spy, family):
    # Scales under which every row's greedy tokens vary and depend on the bias (a query position off by one changes
    # them); conftest's (initializer_factor 5, bias_scale 1) makes Pop2Piano repeat token 0 and Switch ignore the bias
    scales = dict(initializer_factor=2.0, bias_scale=10.0) if family == "switch_transformers" else {}
    settings = dict(attn_implementation=FAMILIES[family][1][0], **scales)
    patched, plain = patch_t5(tiny_model(hf, family, **settings)), tiny_model(hf, family, **settings)
    inputs = encoder_inputs(hf, family, length=24, pad_last=7)
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        got, want = patched.generate(**inputs, **options), plain.generate(**inputs, **options)
    assert any(key_len > query_len for query_len, key_len in spy)  # decoding steps read the KV cache through relbias
    assert torch.equal(got, want)
    assert got.shape[1] == 13 and all(len(set(row.tolist())) > 3 for row in got)  # not one token repeated


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_restores(hf, family):
    model = tiny_model(hf, family)
    patch_t5(model)
    assert is_patched(model)
    unpatch_t5(model)
    assert not is_patched(model)
    assert model.encoder.block[0].layer[0].SelfAttention.config._attn_implementation == "eager"
    assert "compute_bias" not in vars(model.encoder.block[0].layer[0].SelfAttention)


def _longt5(transformers):
    config = transformers.LongT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                       encoder_attention_type="transient-global")
    return transformers.LongT5ForConditionalGeneration(config)


def _udop(transformers):
    config = transformers.UdopConfig(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    return transformers.UdopForConditionalGeneration(config)


def _pix2struct(transformers):
    config = transformers.Pix2StructConfig(
        text_config=dict(vocab_size=64, hidden_size=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
        vision_config=dict(hidden_size=32, patch_embed_hidden_size=32, d_ff=64, d_kv=8, num_hidden_layers=1,
                           num_attention_heads=4),
    )
    return transformers.Pix2StructForConditionalGeneration(config)


@pytest.mark.parametrize("build", [_longt5, _udop, _pix2struct], ids=["longt5", "udop", "pix2struct"])
def test_models_with_another_t5_bias_layout_are_refused(hf, build):
    """LongT5 (local / transient-global encoder attention), UDOP (encoder bias with 2D layout terms) and Pix2Struct
    (another module layout): patch_t5 names the class and patches nothing."""
    model = build(hf.transformers)
    with pytest.raises(TypeError, match=type(model).__name__):
        patch_t5(model)
    assert not is_patched(model)
