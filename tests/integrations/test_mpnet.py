"""patch / patch_mpnet: MPNet models (every head, padding, gradients, attention weights) and a sentence-transformers
model built locally give transformers' own outputs through relbias attention; unpatch restores them exactly."""

import copy
import os
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras)")

from relbias.integrations import mpnet as integration  # noqa: E402
from relbias.integrations.mpnet import is_mpnet_patched, patch_mpnet, unpatch_mpnet  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, check_transformers_version  # noqa: E402
from relbias.integrations.transformers import patch, unpatch  # noqa: E402

from .._tolerance import assert_rounding_close  # noqa: E402

try:
    check_transformers_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

WORDS = "the a of to and in is was for on that with as by at from his it an were are which this be or has had".split()
VOCAB = ["<s>", "<pad>", "</s>", "[UNK]", "<mask>", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]


def _config(**overrides):
    settings = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=600, attention_probs_dropout_prob=0.0,
                    hidden_dropout_prob=0.0)
    return transformers.MPNetConfig(**{**settings, **overrides})


def _model(kind="Model", **overrides):
    torch.manual_seed(0)
    model = getattr(transformers, f"MPNet{kind}")(_config(**overrides)).eval()
    encoder = integration.mpnet_encoder(model)
    with torch.no_grad():  # the bias weighs as much as q.k: a wrong table or bucket shows
        encoder.relative_attention_bias.weight.mul_(10.0)
    return model


def _batch(length=160):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, len(VOCAB), (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, length // 2:] = 0  # right padding
    mask[2, :7] = 0  # left padding
    return ids, mask


def _close(got, want, mask):
    assert_rounding_close(got, want, n=64)  # padded positions too: their queries see the sequence's tokens


@pytest.mark.parametrize("kind", ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification"])
def test_every_head_gives_the_unpatched_outputs(kind, monkeypatch):
    plain = _model(kind)
    patched = patch(copy.deepcopy(plain))
    calls = []
    real = integration.attention
    monkeypatch.setattr(integration, "attention", lambda *a, **k: calls.append(k["bias"]) or real(*a, **k))
    ids, mask = _batch()
    with torch.no_grad():
        got, want = patched(ids, attention_mask=mask), plain(ids, attention_mask=mask)
    name = "last_hidden_state" if kind == "Model" else "logits"
    if kind == "ForSequenceClassification":
        assert_rounding_close(got.logits, want.logits, n=64)
    else:
        _close(getattr(got, name), getattr(want, name), mask)
    assert len(calls) == 2 and calls[0] is calls[1]  # one T5Bias for both layers
    assert calls[0].weight is integration.mpnet_encoder(patched).relative_attention_bias.weight
    assert patched.state_dict().keys() == plain.state_dict().keys()


def test_unpatch_restores_transformers_exactly_and_patch_twice_changes_nothing():
    plain = _model()
    patched = patch_mpnet(copy.deepcopy(plain))
    ids, mask = _batch()
    with pytest.warns(UserWarning, match="already patched .* changes nothing"):
        patch_mpnet(patched)
    with pytest.raises(ValueError, match="backend='reference'"):
        patch_mpnet(patched, backend="reference")
    unpatch(patched)
    assert not is_mpnet_patched(patched)
    with torch.no_grad():
        assert torch.equal(patched(ids, attention_mask=mask).last_hidden_state,
                           plain(ids, attention_mask=mask).last_hidden_state)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_mpnet(patched)


def test_gradients_and_attention_weights_match():
    plain, ids, mask = _model(), *_batch(60)
    patched = patch_mpnet(copy.deepcopy(plain))
    grads = []
    weights = torch.randn(3, 60, 32, generator=torch.Generator().manual_seed(2)) * mask[..., None]  # real tokens
    for model in (patched, plain):
        model.zero_grad()
        (model(ids, attention_mask=mask).last_hidden_state * weights).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, want in grads[1].items():
        if name.endswith("attn.k.bias"):  # exactly 0 (softmax ignores a constant per query): rounding noise on both
            scale = grads[1][name.replace("bias", "weight")].abs().max()
            assert grads[0][name].abs().max() <= 1e-4 * scale and want.abs().max() <= 1e-4 * scale
            continue
        assert_rounding_close(grads[0][name], want, n=64 * 60)
    with torch.no_grad():
        got = patched(ids, attention_mask=mask, output_attentions=True).attentions
        want = plain(ids, attention_mask=mask, output_attentions=True).attentions
    rows = mask.bool()[:, None, :, None]  # queries that see keys
    for g, w in zip(got, want):
        assert_rounding_close(g.masked_fill(~rows, 0), w.masked_fill(~rows, 0), n=60)


def test_a_patched_model_copies_saves_and_loads_unpatched():
    plain, ids, mask = _model(), *_batch(40)
    patched = patch_mpnet(copy.deepcopy(plain))
    with torch.no_grad():
        want = patched(ids, attention_mask=mask).last_hidden_state
        for clone in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
            assert torch.equal(clone(ids, attention_mask=mask).last_hidden_state, want)
    fresh = transformers.MPNetModel(_config()).eval()
    fresh.load_state_dict(patched.state_dict())
    with torch.no_grad():
        _close(fresh(ids, attention_mask=mask).last_hidden_state, want, mask)


def test_refusals():
    with pytest.raises(TypeError, match="relbias patches T5-family models .* MPNet models .* the ALiBi decoders"):
        patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="holds no transformers MPNetEncoder"):
        patch_mpnet(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"relative_attention_bias has shape \(16, 4\)"):
        patch_mpnet(_model(relative_attention_num_buckets=16))
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        patch_mpnet(_model(), backend="nope")


def test_a_sentence_transformer_encodes_the_same_embeddings(tmp_path, monkeypatch):
    """A SentenceTransformer made from a local MPNet (config, random weights, a tokenizer built here), saved to a
    folder and loaded from it; patched, ``encode`` gives the same embeddings."""
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = transformers.MPNetTokenizer(vocab={token: i for i, token in enumerate(VOCAB)})
    _model().save_pretrained(tmp_path / "mpnet")
    tokenizer.save_pretrained(tmp_path / "mpnet")
    modules = [Transformer(str(tmp_path / "mpnet"), max_seq_length=512), Pooling(32, "mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    plain = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    patched = patch(SentenceTransformer(str(tmp_path / "st"), device="cpu"))
    assert is_mpnet_patched(patched)
    texts = ["the cat was on a mat", "a", " ".join(WORDS * 8), "which of this is the one that was at the mat"]
    want = plain.encode(texts, convert_to_tensor=True, batch_size=4)
    got = patched.encode(texts, convert_to_tensor=True, batch_size=4)
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.99999
    assert (got - want).abs().max() <= 1e-5
