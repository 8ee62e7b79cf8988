"""Patched LongT5 (local and transient-global), MPNet and the ALiBi decoders (BLOOM, MPT, Falcon) in bfloat16
(``model.to(torch.bfloat16)`` and ``torch.autocast``): outputs no further from the float32 model than transformers'
own bfloat16 model is (up to 2 eps: the two round differently) and within a few eps of it; greedy tokens as
transformers' bfloat16 where its tokens are the float32 model's; one training step's loss and gradient norm within
bfloat16's resolution of transformers'. transformers' models run eager attention (as in
``test_half_precision_models.py``, which covers T5), Falcon its SDPA path on SDPA's math backend (transformers
5.24's eager ALiBi Falcon is not its SDPA one: 3e-2 apart in float32, where the patch follows SDPA's). Tiny configs,
random weights, padded batches."""

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras)")

from relbias.integrations.common import check_transformers_version  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, patch  # noqa: E402

try:
    check_transformers_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

from ._bfloat16 import EPS, assert_generate_and_training_step_as_transformers  # noqa: E402
from ._bfloat16 import relative_error as _error  # noqa: E402

VOCAB, LENGTH = 64, 48


def _longt5(kind):
    return transformers.LongT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, local_radius=5, global_block_size=4,
        encoder_attention_type=kind, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )


FALCON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, bias=True,
              hidden_dropout=0.0, attention_dropout=0.0, new_decoder_architecture=False)
#: name -> (transformers class, config, padding side, seq2seq)
MODELS = {
    "longt5-local": ("LongT5ForConditionalGeneration", lambda: _longt5("local"), "right", True),
    "longt5-tglobal": ("LongT5ForConditionalGeneration", lambda: _longt5("transient-global"), "right", True),
    "mpnet": ("MPNetModel", lambda: transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0), "right", False),
    "bloom": ("BloomForCausalLM", lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2,
                                                                   n_head=6), "left", False),
    "mpt": ("MptForCausalLM", lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6,
                                                             max_seq_len=64), "left", False),
    "falcon": ("FalconForCausalLM", lambda: transformers.FalconConfig(**FALCON), "left", False),
}


def _model(name, patched):
    cls, config, _, _ = MODELS[name]
    torch.manual_seed(0)
    implementation = "sdpa" if name == "falcon" else "eager"
    model = getattr(transformers, cls)._from_config(config(), attn_implementation=implementation).eval()
    return patch(model) if patched else model


def _sdpa_math(name):
    """SDPA's math backend for Falcon's baseline (its CPU flash kernel refuses bfloat16 on AMX under
    ATEN_CPU_CAPABILITY=default); nothing for the others."""
    return sdpa_kernel(SDPBackend.MATH) if name == "falcon" else contextlib.nullcontext()


def _batch(name):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, LENGTH), generator=g)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if MODELS[name][2] == "right":
        mask[1, LENGTH - 11:] = 0
    else:
        mask[1, :11] = 0
    return ids, mask


def _outputs(name, model, ids, mask):
    """The model's output at the real tokens, (tokens, width)."""
    if MODELS[name][3]:
        out = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    else:
        found = model(input_ids=ids, attention_mask=mask)
        out = found.logits if hasattr(found, "logits") else found.last_hidden_state
    return out[mask.bool()]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_outputs_as_transformers_bfloat16(name, autocast):
    ids, mask = _batch(name)
    full, plain, patched = _model(name, False), _model(name, False), _model(name, True)
    with torch.no_grad(), _sdpa_math(name):
        want = _outputs(name, full, ids, mask)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                theirs, ours = _outputs(name, plain, ids, mask), _outputs(name, patched, ids, mask)
        else:
            plain, patched = plain.to(torch.bfloat16), patched.to(torch.bfloat16)
            theirs, ours = _outputs(name, plain, ids, mask), _outputs(name, patched, ids, mask)
    assert ours.dtype == theirs.dtype
    assert torch.isfinite(ours).all()
    assert _error(ours, want) <= _error(theirs, want) + 2 * EPS, (_error(ours, want), _error(theirs, want))
    assert _error(ours, theirs) <= 8 * EPS, _error(ours, theirs)


@pytest.mark.parametrize("name", [name for name in MODELS if name != "mpnet"])
def test_bfloat16_generate_and_training_step_as_transformers(name):
    ids, mask = _batch(name)
    full = _model(name, False)
    plain, patched = _model(name, False).to(torch.bfloat16), _model(name, True).to(torch.bfloat16)
    labels = ids[:, :12].contiguous() if MODELS[name][3] else ids.masked_fill(mask == 0, -100)
    with _sdpa_math(name):
        assert_generate_and_training_step_as_transformers(full, plain, patched, ids, mask, labels, max_new_tokens=6,
                                                          min_new_tokens=6, pad_token_id=0)
