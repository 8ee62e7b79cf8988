"""patch_longt5 / patch: LongT5 models (local and transient-global encoders) give transformers' own outputs, gradients
and tokens through relbias attention, padded batches included; unpatch restores them exactly."""

import copy
import io
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras)")

from relbias.integrations import longt5 as integration  # noqa: E402
from relbias.integrations import longt5_attention as parts  # noqa: E402
from relbias.integrations.longt5 import is_longt5_patched, patch_longt5, unpatch_longt5  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, check_transformers_version  # noqa: E402
from relbias.integrations.transformers import patch, unpatch  # noqa: E402

try:
    check_transformers_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

KINDS = ["local", "transient-global"]
VOCAB = 64
TOL = 1e-5


def _model(kind, cls="ForConditionalGeneration", **overrides):
    """2 layers, 4 heads; blocks of 6 tokens (local_radius 5), summaries of 4; 8 buckets up to distance 16, so that
    the band and the side bias reach the log and saturated buckets; tables weighing as much as q.k."""
    settings = dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, local_radius=5, global_block_size=4,
        encoder_attention_type=kind, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, f"LongT5{cls}")(transformers.LongT5Config(**settings)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "relative_attention_bias" in name:
                parameter.mul_(10.0)
    return model


def _batch(length):
    """Four rows: full, right padding (a whole summary block and more), right padding of one token (no empty
    summary block: padding then sees every slot), left padding."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(2, VOCAB, (4, length), generator=g)
    mask = torch.ones(4, length, dtype=torch.long)
    mask[1, length // 2:] = 0
    mask[2, length - 1:] = 0
    mask[3, :5] = 0
    return ids, mask


def _encode(model, ids, mask):
    with torch.no_grad():
        return model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [3, 7, 24, 41, 70])
def test_encoder_outputs_equal_the_unpatched_ones_padding_included(kind, length):
    model = _model(kind)
    ids, mask = _batch(length)
    want = _encode(model, ids, mask)
    calls = []
    real = integration.attention
    counted = lambda *a, **k: calls.append(k.get("window")) or real(*a, **k)  # noqa: E731
    integration.attention = parts.attention = counted  # the local call, and the summaries' call
    try:
        patch_longt5(model)
        got = _encode(model, ids, mask)
    finally:
        integration.attention = parts.attention = real
    assert (got - want).abs().max().item() <= TOL  # every position, padded ones too
    assert (5, 5) in calls  # the local band as one windowed call
    summaries = kind == "transient-global" and length >= 4  # no summary key below one global block
    assert len(calls) == 2 * (2 if summaries else 1)
    unpatch_longt5(model)
    assert torch.equal(_encode(model, ids, mask), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [40, 41])
def test_unpadded_batches_without_a_mask(kind, length):
    model = _model(kind)
    ids, _ = _batch(length)
    with torch.no_grad():
        want = model.get_encoder()(input_ids=ids).last_hidden_state
        patch_longt5(model)
        got = model.get_encoder()(input_ids=ids).last_hidden_state
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_unpatched_ones(kind):
    ids, mask = _batch(41)
    labels = torch.randint(2, VOCAB, (4, 9), generator=torch.Generator().manual_seed(3))
    grads = []
    for patched in (False, True):
        model = _model(kind).train()  # dropout_rate 0: training mode without randomness
        if patched:
            patch_longt5(model)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any("global_relative_attention_bias" in name for name in grads[1]) == (kind == "transient-global")
    worst = max((grads[0][name] - grads[1][name]).abs().max().item() for name in grads[0])
    assert worst <= TOL, worst


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [7, 41])
def test_gradients_through_every_position_padding_included(kind, length):
    """A loss over every encoder output, padded positions too: their rows' gradients are transformers' (softmax at
    uniform weights reaches queries, keys and both tables)."""
    ids, mask = _batch(length)
    weights = torch.randn(4, length, 32, generator=torch.Generator().manual_seed(5))
    grads = []
    for patched in (False, True):
        model = _model(kind, cls="EncoderModel").train()
        if patched:
            patch_longt5(model)
        (model(input_ids=ids, attention_mask=mask).last_hidden_state * weights).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    worst = max((grads[0][name] - grads[1][name]).abs().max().item() for name in grads[0])
    scale = max(g.abs().max().item() for g in grads[0].values())
    assert worst <= TOL * max(1.0, scale), (worst, scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pads", [[0, 1, 5, 6, 7, 13, 25, 31, 40, 48], [5, 7, 13, 25, 31, 40, 48]])
def test_ragged_batches_at_many_padding_lengths(kind, pads):
    """Rows padded by 0 to 48 of 49 tokens (one token, which leaves no summary block empty; inside a block, a whole
    block, a summary block and more; all but one), and a batch whose every row is padded (the calls stop at its
    longest row): the outputs transformers gives, without gradients (padding's rows from per-block sums) and with
    them (padding's blocks scored), and the gradients of every position's output."""
    length = 49
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, (len(pads), length), generator=g)
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, length - pad:] = 0
    weights = torch.randn(len(pads), length, 32, generator=g)
    results = []
    for patched in (False, True):
        model = _model(kind, cls="EncoderModel")
        if patched:
            patch_longt5(model)
        encoder = model.get_encoder()
        with torch.no_grad():
            inference = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        out = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * weights).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((inference, out.detach(), grads))
    (want, want_graded, want_grads), (got, got_graded, got_grads) = results
    assert (got - want).abs().max().item() <= TOL
    assert (got_graded - want_graded).abs().max().item() <= TOL
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        scale = max(1.0, want_grads[name].abs().max().item())
        assert (got_grads[name] - want_grads[name]).abs().max().item() <= TOL * scale, name


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_and_beam_tokens_are_the_unpatched_ones(kind):
    model = _model(kind)
    ids, mask = _batch(41)
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    with torch.no_grad():
        greedy, beam = model.generate(**settings, do_sample=False), model.generate(**settings, num_beams=3)
        patch(model)  # the front door
        assert is_longt5_patched(model)
        assert torch.equal(model.generate(**settings, do_sample=False), greedy)
        assert torch.equal(model.generate(**settings, num_beams=3), beam)
    unpatch(model)
    assert not is_longt5_patched(model)


@pytest.mark.parametrize("cls", ["Model", "EncoderModel"])
def test_the_other_models(cls):
    model = _model("transient-global", cls=cls)
    ids, mask = _batch(30)
    kwargs = {} if cls == "EncoderModel" else {"decoder_input_ids": ids[:, :6]}
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
        patch_longt5(model)
        got = model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_output_attentions_are_transformers_own(kind):
    model = _model(kind)
    ids, mask = _batch(30)
    with torch.no_grad():
        want = model.get_encoder()(input_ids=ids, attention_mask=mask, output_attentions=True)
        patch_longt5(model)
        got = model.get_encoder()(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        assert torch.equal(a, b)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)


def test_state_dict_copies_pickles_and_errors(tmp_path):
    model = _model("transient-global")
    ids, mask = _batch(24)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch_longt5(model)
    assert model.state_dict().keys() == before.keys()
    with pytest.warns(UserWarning, match="already patched .* changes nothing"):
        patch_longt5(model)
    with pytest.raises(ValueError, match="already patched .*backend='reference'"):
        patch_longt5(model, backend="reference")
    with torch.no_grad():
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5)
        for other in (copy.deepcopy(model), pickle.load(io.BytesIO(pickle.dumps(model)))):
            assert is_longt5_patched(other)
            assert torch.equal(other.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5), tokens)
    model.save_pretrained(tmp_path)
    loaded = transformers.LongT5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert not is_longt5_patched(loaded)
    with torch.no_grad():
        assert torch.equal(loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5), tokens)
    unpatch_longt5(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_longt5(model)
    with pytest.raises(TypeError, match="LongT5"):
        patch_longt5(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown backend"):
        patch_longt5(model, backend="nope")


def test_training_with_dropout_runs_and_keeps_the_distribution():
    model = _model("transient-global", dropout_rate=0.1).train()
    patch_longt5(model)
    ids, mask = _batch(41)
    labels = torch.randint(2, VOCAB, (4, 9), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", KINDS)
def test_float16_runs_where_transformers_overflows(kind):
    """transformers' -1e10 fill overflows float16 (its encoder returns NaN in 5.25); the patched encoder stays near
    float32."""
    ids, mask = _batch(41)
    with torch.no_grad():
        want = _encode(_model(kind), ids, mask)
        half = patch_longt5(_model(kind).half())
        got = _encode(half, ids, mask)
    assert torch.isfinite(got).all()
    assert (got.float() - want).abs().max().item() <= 2e-2
