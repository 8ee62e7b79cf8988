"""Tiny T5-family models from configs with random weights: no downloads (HF_HUB_OFFLINE=1)."""

import os
import types

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

try:
    import transformers
except ImportError:  # the helpers skip; tests that need no model still run
    transformers = None

MISSING = "transformers is not installed (the 'hf' / 'dev' extras install it)"

VOCAB = 64


def tiny_config(family: str = "t5", **overrides):
    """A 2-layer, 4-head config; 8 buckets / max_distance 16 so that ~40 tokens reach the log and saturated buckets."""
    cls = {"t5": transformers.T5Config, "mt5": transformers.MT5Config, "umt5": transformers.UMT5Config}[family]
    settings = dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    settings.update(overrides)
    return cls(**settings)


def tiny_model(
    family: str = "t5",
    kind: str = "ForConditionalGeneration",
    attn_implementation: str = "sdpa",
    bias_scale: float = 10.0,
    **overrides,
):
    """A model of class ``{T5,MT5,UMT5}{kind}`` in eval mode, seeded, its bias tables multiplied by ``bias_scale``.

    The default scale (table std 1.8 logits) makes the position bias weigh as much as q.k; with it, fp32 outputs of
    two correct implementations differ by ~1e-6. A larger ``initializer_factor`` (e.g. 5) makes greedy decoding
    vary its tokens, but also amplifies rounding (~5e-5), so it is for token-level comparisons only.
    """
    torch.manual_seed(0)
    prefix = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}[family]
    cls = getattr(transformers, prefix + kind)
    model = cls._from_config(tiny_config(family, **overrides), attn_implementation=attn_implementation).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                parameter.mul_(bias_scale)
    return model


def batch(batch_size: int = 2, length: int = 40, pad_last: int = 0, seed: int = 1):
    """input_ids (B, L) in [2, VOCAB) and an attention mask whose last row has ``pad_last`` right-padded tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (batch_size, length), generator=generator)
    attention_mask = torch.ones(batch_size, length, dtype=torch.long)
    if pad_last:
        attention_mask[-1, length - pad_last:] = 0
        input_ids[-1, length - pad_last:] = 0
    return input_ids, attention_mask


def enable_checkpointing(model) -> None:
    """Activation checkpointing on ``model``: transformers' ``activation_checkpointing_enable`` where it exists
    (its ``gradient_checkpointing_enable`` is deprecated there), the older name on transformers that lack it."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


@pytest.fixture
def hf():
    """The helpers above, for test modules (importlib import mode cannot import conftest)."""
    if transformers is None:
        pytest.skip(MISSING)
    return types.SimpleNamespace(transformers=transformers, tiny_config=tiny_config, tiny_model=tiny_model, batch=batch,
                                 enable_checkpointing=enable_checkpointing)
