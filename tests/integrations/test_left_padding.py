"""A query row with no visible key (a left pad of a causal batch, a sequence that is all padding) gets what
transformers gives it: the mean of the values, with the gradients of softmax at uniform weights. A left-padded
training step of every patched family then gives the unpatched loss and gradients, at the default and at a large
initialisation, while relbias.attention itself keeps zeros for such rows."""

import contextlib
import copy

import pytest
import torch
from packaging.version import Version
from torch.nn.attention import SDPBackend, sdpa_kernel

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras)")

import relbias  # noqa: E402
from relbias.integrations.hidden_rows import fill_hidden_rows, hidden_rows  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, check_transformers_version, patch  # noqa: E402

try:
    check_transformers_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

VOCAB, LENGTH = 64, 20
LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-4
#: A parameter whose gradient stays below this fraction of the model's largest (a key projection's bias: softmax
#: ignores it, so its exact gradient is 0) is compared at that fraction.
GRAD_FLOOR = 1e-2


def _std(large):
    return 0.5 if large else 0.02


def _falcon(**kw):
    return transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     alibi=True, bias=True, hidden_dropout=0.0, attention_dropout=0.0, **kw)


# name -> (model class, config of (large init: bool)); BLOOM, MPT, Falcon and MPNet at initializer_range 0.5 when
# large, T5 at initializer_factor 1.5 (its unscaled scores grow fast: at 2, float32 rounding alone reaches 1e-4).
MODELS = {
    "bloom": ("BloomForCausalLM", lambda large: transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=48, n_layer=3, n_head=6, initializer_range=_std(large))),
    "mpt": ("MptForCausalLM", lambda large: transformers.MptConfig(
        vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6, max_seq_len=64, initializer_range=_std(large))),
    "falcon": ("FalconForCausalLM", lambda large: _falcon(
        multi_query=False, parallel_attn=False, new_decoder_architecture=False, initializer_range=_std(large))),
    "falcon-new": ("FalconForCausalLM", lambda large: _falcon(
        new_decoder_architecture=True, num_kv_heads=2, initializer_range=_std(large))),
    "t5": ("T5ForConditionalGeneration", lambda large: transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=1.5 if large else 1.0)),
    "mpnet": ("MPNetForSequenceClassification", lambda large: transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, initializer_range=_std(large))),
}
# The attention implementations each patch runs (BLOOM, MPT and MPNet have eager attention only).
CASES = [("bloom", "eager"), ("mpt", "eager"), ("falcon", "eager"), ("falcon", "sdpa"), ("falcon-new", "sdpa"),
         ("t5", "eager"), ("t5", "sdpa"), ("mpnet", "eager")]


def _model(name, implementation, large):
    if name.startswith("falcon") and implementation == "eager" and Version(transformers.__version__) < Version("5.25"):
        # 5.24's eager Falcon adds ALiBi twice: to the scores and again through the mask it builds from ALiBi (5.25
        # rewrote it); relbias follows 5.25's eager and every release's sdpa path, which add it once
        pytest.skip("transformers < 5.25's eager Falcon adds the ALiBi bias twice; compared on 5.25 and on sdpa")
    torch.manual_seed(0)
    class_name, config = MODELS[name]
    return getattr(transformers, class_name)._from_config(config(large), attn_implementation=implementation).train()


def _batch():
    """Left padding (9 and 3 pads) and, in the first row, none."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (3, LENGTH), generator=g)
    mask = torch.ones(3, LENGTH, dtype=torch.long)
    mask[1, :9] = 0
    mask[2, :3] = 0
    return ids, mask


def _loss(model, name):
    """The loss of one training step on a left-padded batch, with the usual labels: padding is -100."""
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    if name == "t5":
        # Encoder: the first sequence all padding (its every row hidden). Decoder: left-padded causal language
        # modelling, each position predicting the next token, so the last pad's output predicts the first real one.
        encoder_mask = mask.clone()
        encoder_mask[0] = 0
        next_tokens = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], dim=1)
        return model(input_ids=ids, attention_mask=encoder_mask, decoder_input_ids=ids, decoder_attention_mask=mask,
                     labels=next_tokens).loss
    if name == "mpnet":  # bidirectional: only a sequence that is all padding has hidden rows
        mask[0] = 0
        return model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 0])).loss
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss  # shifted inside: causal language modelling


def _step(model, name, implementation):
    """Loss and gradients of one step. SDPA runs its math kernel: torch's CPU flash kernel gives a row whose keys
    are all at the finite mask minimum Lk times the gradient of its own (uniform) forward, its log-sum-exp lost in
    the fill's rounding."""
    model.zero_grad()
    with sdpa_kernel(SDPBackend.MATH) if implementation == "sdpa" else contextlib.nullcontext():
        loss = _loss(model, name)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _differences(plain, name, implementation):
    """(|loss difference|, largest gradient difference relative to its parameter's scale), patched vs plain."""
    want_loss, want = _step(plain, name, implementation)
    got_loss, got = _step(patch(copy.deepcopy(plain)), name, implementation)
    assert got.keys() == want.keys()
    largest = max(g.abs().max() for g in want.values())
    scales = {k: torch.maximum(g.abs().max(), GRAD_FLOOR * largest) for k, g in want.items()}
    return (got_loss - want_loss).abs().item(), max(((got[k] - want[k]).abs().max() / scales[k]).item() for k in want)


@pytest.mark.parametrize("large", [False, True], ids=["default-init", "large-init"])
@pytest.mark.parametrize(("name", "implementation"), CASES)
def test_left_padded_training_step_matches_unpatched(name, implementation, large):
    loss, grads = _differences(_model(name, implementation, large), name, implementation)
    assert loss <= LOSS_ATOL and grads <= GRAD_RTOL, (loss, grads)


def test_the_hidden_rows_matter_to_the_step():
    """Without the fill (relbias' zeros in hidden rows) the same BLOOM step is off by far more than the bounds."""
    plain = _model("bloom", "eager", large=True)
    unfilled = patch(copy.deepcopy(plain))
    with pytest.MonkeyPatch.context() as monkeypatch:
        from relbias.integrations import alibi_common

        monkeypatch.setattr(alibi_common, "fill_hidden_rows", lambda out, *args, **kwargs: out)
        got_loss, got = _step(unfilled, "bloom", "eager")
    want_loss, want = _step(plain, "bloom", "eager")
    assert (got_loss - want_loss).abs() > 100 * LOSS_ATOL
    assert max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want) > 100 * GRAD_RTOL


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon", "t5", "mpnet"])
def test_output_attentions_show_uniform_weights_in_hidden_rows(name):
    plain = _model(name, "eager", large=False).eval()
    ids, mask = _batch()
    inputs = dict(input_ids=ids, attention_mask=mask, output_attentions=True)
    hidden = (1, slice(0, 9))  # the second sequence's 9 left pads
    if name == "t5":
        inputs.update(decoder_input_ids=ids, decoder_attention_mask=mask)
    elif name == "mpnet":  # bidirectional: the hidden rows are those of a sequence that is all padding
        inputs["attention_mask"] = mask.clone().index_fill_(0, torch.tensor([1]), 0)
        hidden = (1, slice(None))
    with torch.no_grad():
        want = plain(**inputs)
        got = patch(copy.deepcopy(plain))(**inputs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)  # every row, pads included
    attentions = "decoder_attentions" if name == "t5" else "attentions"
    for g, w in zip(getattr(got, attentions), getattr(want, attentions), strict=True):
        rows = g[hidden[0], :, hidden[1]]
        assert torch.equal(rows, torch.full_like(rows, 1 / LENGTH))  # 1/Lk on every key
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_cached_decoding_after_a_left_padded_prefill_matches_unpatched():
    """The cache holds the pads' keys and values as transformers computes them (their rows fed the next layers)."""
    plain = _model("bloom", "eager", large=True).eval()
    patched = patch(copy.deepcopy(plain))
    ids, mask = _batch()
    steps = {}
    with torch.no_grad():
        for label, model in (("want", plain), ("got", patched)):
            cache = transformers.DynamicCache(config=model.config)
            logits = [model(input_ids=ids[:, :15], attention_mask=mask[:, :15], cache=cache,
                            use_cache=True).logits]
            for t in range(15, LENGTH):
                logits.append(model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache,
                                    use_cache=True).logits)
            keys = torch.stack([layer.keys for layer in cache.layers])
            steps[label] = torch.cat(logits, dim=1), keys
    torch.testing.assert_close(steps["got"][0], steps["want"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps["got"][1], steps["want"][1], rtol=1e-4, atol=1e-4)


def test_relbias_attention_keeps_zeros_and_the_fill_is_the_mean():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    visible = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    visible[1, ..., :2] = False  # rows 0 and 1 of the second sequence see nothing
    out = relbias.attention(q, k, v, mask=visible)
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))
    hidden = hidden_rows(visible)
    assert hidden.shape == (2, 1, 6, 1) and hidden.sum() == 2
    filled = fill_hidden_rows(out, q, k, v, hidden, scale=8 ** -0.5)
    assert torch.equal(filled[0], out[0]) and torch.equal(filled[1, :, 2:], out[1, :, 2:])
    torch.testing.assert_close(filled[1, :, :2], v[1].mean(dim=1, keepdim=True).expand(-1, 2, -1))
    # The gradients are softmax's at uniform weights, as transformers' finite fill gives them.
    fill = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    scores = q @ k.transpose(-2, -1) * 8 ** -0.5 + fill
    reference = scores.softmax(dim=-1) @ v
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(filled, (q, k, v), grad),
                               torch.autograd.grad(reference, (q, k, v), grad))
    assert hidden_rows(torch.ones(2, 1, 6, 6, dtype=torch.bool)) is None and hidden_rows(None) is None


def test_compiled_fill_selects_rows_without_reading_the_mask():
    """Under torch.compile (fullgraph: no value-dependent branch) the rows are selected with torch.where over every
    query; values and gradients (query, keys, values, a bias table, GQA) are the eager call's."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(2))
    bias = relbias.T5Bias(4, num_buckets=8, max_distance=16, bidirectional=False)
    visible = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    visible[1, ..., :3] = False
    out = torch.randn(2, 4, 6, 8, requires_grad=True)

    def fill(out, q, k, v, visible):
        return fill_hidden_rows(out, q, k, v, hidden_rows(visible), scale=0.5, bias=bias, query_start=0)

    compiled = torch.compile(fill, fullgraph=True, backend="aot_eager")
    grad = torch.randn(2, 4, 6, 8)
    inputs = (out, q, k, v, bias.weight)
    want = fill(out, q, k, v, visible)
    got = compiled(out, q, k, v, visible)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad))
