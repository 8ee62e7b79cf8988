"""patch / patch_alibi: BLOOM, MPT and ALiBi Falcon give transformers' own outputs, tokens (greedy, beam, static
cache) and gradients through relbias attention, with the bias read per offset; unpatch restores them exactly."""

import copy
import pickle

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras)")

import relbias  # noqa: E402
from relbias.integrations import alibi_common, alibi_decoders  # noqa: E402
from relbias.integrations.alibi_decoders import is_alibi_patched, patch_alibi, unpatch_alibi  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, check_transformers_version  # noqa: E402
from relbias.integrations.transformers import patch, unpatch  # noqa: E402

from .._tolerance import assert_rounding_close  # noqa: E402

try:
    check_transformers_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

VOCAB, LENGTH = 64, 40
_FALCON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, bias=True,
               hidden_dropout=0.0, attention_dropout=0.0)
CONFIGS = {  # 6 heads: slopes of a non-power-of-two head count; Falcon keeps 4 (see test_falcon_bias_...)
    "bloom": lambda **kw: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6, **kw),
    "bloom-tp": lambda **kw: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,
                                                      pretraining_tp=2, slow_but_exact=True, **kw),
    "mpt": lambda **kw: transformers.MptConfig(**{**dict(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6,
                                                         max_seq_len=64), **kw}),
    "mpt-max16": lambda **kw: transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                                     max_seq_len=64, attn_config={"alibi_bias_max": 16}, **kw),
    "falcon": lambda **kw: transformers.FalconConfig(**{**_FALCON, **kw}, multi_query=False, parallel_attn=False,
                                                     new_decoder_architecture=False),
    "falcon-multi-query": lambda **kw: transformers.FalconConfig(**{**_FALCON, **kw}, multi_query=True, parallel_attn=True,
                                                                 new_decoder_architecture=False),
    "falcon-new": lambda **kw: transformers.FalconConfig(**{**_FALCON, **kw}, new_decoder_architecture=True,
                                                         num_kv_heads=2),
}
CLASSES = {"bloom": "BloomForCausalLM", "mpt": "MptForCausalLM", "falcon": "FalconForCausalLM"}


def _model(name, **overrides):
    torch.manual_seed(0)
    cls = getattr(transformers, CLASSES[name.split("-")[0]])
    return cls(CONFIGS[name](**overrides)).eval()


def _batch(padding="left"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, LENGTH), generator=g)
    mask = torch.ones(3, LENGTH, dtype=torch.long)
    if padding == "left":
        mask[1, :9] = 0
        mask[2, :1] = 0
    elif padding == "right":
        mask[1, 30:] = 0
    elif padding == "holes":
        mask[1, 5:9] = 0
        mask[2, :3] = 0
        mask[2, 20] = 0
    return ids, mask


def _close(got, want, mask=None):
    """Every position, padded queries included (a left pad sees no key: the patch gives it transformers' mean of the
    values), or only the positions ``mask`` keeps."""
    if mask is not None:
        keep = mask.bool()[..., None].expand_as(got)
        got, want = got[keep], want[keep]
    assert_rounding_close(got, want, n=LENGTH)


def _calls(monkeypatch):
    """Record the bias and mask of every relbias.attention call the patched layers make."""
    seen = []
    real = alibi_common.attention

    def spy(query, key, value, **kwargs):
        seen.append((kwargs.get("bias"), kwargs.get("mask"), tuple(key.shape)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(alibi_common, "attention", spy)
    return seen


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padding", ["none", "left", "right", "holes"])
def test_logits_match_unpatched(name, padding):
    model = _model(name)
    ids, mask = _batch(padding)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        if name == "mpt-max16":  # transformers' MPT builds slopes with 8 whatever the config says: so does the patch
            with pytest.warns(UserWarning, match="alibi_bias_max=16, but transformers' MPT builds its slopes with 8"):
                patch(model)
        else:
            patch(model)
        assert is_alibi_patched(model)
        got = model(input_ids=ids, attention_mask=mask).logits
    _close(got, want)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_offsets_are_read_per_offset_with_left_padding(name, monkeypatch):
    """Prefill and cached decoding run on the ALiBiBias with at most a (B, 1, 1, Lk) key padding mask."""
    model = patch(_model(name))
    seen = _calls(monkeypatch)
    ids, mask = _batch("left")
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(seen) == 3 * 2  # 3 forwards (prefill, 2 steps) x 2 layers
    for bias, mask_seen, key_shape in seen:
        assert isinstance(bias, relbias.ALiBiBias) and not bias.bidirectional
        assert mask_seen is None or tuple(mask_seen.shape) == (3, 1, 1, key_shape[2])
    assert {shape[2] for _, _, shape in seen} == {LENGTH, LENGTH + 1, LENGTH + 2}


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_attention_dropout_is_the_models_in_training_only(name, monkeypatch):
    if name == "mpt":  # transformers' MptAttentionConfig types attn_pdrop as an int: set on the layers instead
        model = _model(name)
        for block in model.transformer.blocks:
            block.attn.attn_dropout_p = 0.25
    else:
        model = _model(name, attention_dropout=0.25)
    patch(model)
    seen = []
    real = alibi_common.attention
    monkeypatch.setattr(alibi_common, "attention", lambda *a, **kw: seen.append(kw["dropout_p"]) or real(*a, **kw))
    ids, mask = _batch("left")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model.train()
        model(input_ids=ids, attention_mask=mask)
    assert seen == [0.0, 0.0, 0.25, 0.25]  # 2 layers in eval, then in training


@pytest.mark.parametrize("name", ["bloom", "falcon"])
def test_holes_in_the_mask_take_the_models_own_positions(name, monkeypatch):
    """BLOOM and Falcon count positions over visible tokens: with a hole, offsets differ from them, so the model's
    per-key bias runs densely (test_logits_match_unpatched checks the values)."""
    model = patch(_model(name))
    seen = _calls(monkeypatch)
    ids, mask = _batch("holes")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert all(bias is None and mask_seen.is_floating_point() for bias, mask_seen, _ in seen)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon", "falcon-new"])
def test_greedy_and_beam_tokens_identical(name):
    model = _model(name)
    ids, mask = _batch("left")
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        greedy, beam = model.generate(**settings), model.generate(**settings, num_beams=3)
        patch(model)
        assert torch.equal(model.generate(**settings), greedy)
        assert torch.equal(model.generate(**settings, num_beams=3), beam)


@pytest.mark.parametrize("name", ["bloom", "falcon"])
def test_static_cache_tokens_identical(name):
    """A StaticCache (keys of its full length, unfilled slots masked) gives the dynamic cache's tokens. (Unpatched
    Falcon fails with a static cache in transformers 5.24 and 5.25, so both compare with the unpatched dynamic
    cache.)"""
    model = _model(name)
    ids, mask = _batch("left")
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(**settings)
        patch(model)
        assert torch.equal(model.generate(**settings, cache_implementation="static"), want)


@pytest.mark.parametrize("name", ["bloom", "falcon", "falcon-new"])
def test_compiled_static_cache_generation(name):
    """generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True)) on a left-padded batch
    (transformers gives MPT no static cache and compiles none of its steps; patched Falcon runs a static cache that
    unpatched Falcon fails with in 5.24 and 5.25, so the tokens are compared with the dynamic cache's): the decoding
    step compiles whole once (the static cache's tensor positions reach the patch as tensors, and nothing branches
    on the mask's values), a second prompt of the same shape recompiles nothing, and the tokens are unpatched eager
    transformers'."""
    model = _model(name)
    ids, mask = _batch("left")
    other = torch.randint(1, VOCAB, ids.shape, generator=torch.Generator().manual_seed(7))
    settings = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager")
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only otherwise (as its own tests do)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    try:
        with torch.no_grad():
            want = [model.generate(x, **settings) for x in (ids, other)]
            patch(model)
            before = counters["stats"]["unique_graphs"]
            got = model.generate(ids, cache_implementation="static", compile_config=compile_config, **settings)
            compiled_graphs = counters["stats"]["unique_graphs"] - before
            with torch.compiler.set_stance("fail_on_recompile"):
                got_other = model.generate(other, cache_implementation="static", compile_config=compile_config,
                                           **settings)
    finally:
        torch._dynamo.reset()
    assert compiled_graphs == 1  # the decoding step, compiled whole once: not skipped, not once per position
    assert torch.equal(got, want[0]) and torch.equal(got_other, want[1])
    assert not torch.equal(got, got_other)


def test_mpt_runs_past_max_seq_len_once_patched():
    """transformers' MPT cannot broadcast its (H, 1, max_seq_len) bias past max_seq_len; patched, ALiBi needs no
    table: the outputs are those of the same weights with a longer max_seq_len."""
    short = _model("mpt", max_seq_len=16)
    long = _model("mpt", max_seq_len=64)
    long.load_state_dict(short.state_dict())
    ids, mask = _batch("left")
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            short(input_ids=ids, attention_mask=mask)
        want = long(input_ids=ids, attention_mask=mask).logits
        patch(short)
        got = short(input_ids=ids, attention_mask=mask).logits
    _close(got, want)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_gradients_match(name):
    model = _model(name).train()
    ids, mask = _batch("left")

    def grads():
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits * mask[..., None]).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads()
    patch(model)
    got = grads()
    assert got.keys() == want.keys()
    for key in want:
        assert_rounding_close(got[key], want[key], n=3 * LENGTH)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_output_attentions_match(name):
    """Falcon against transformers' eager attention, where that adds the bias once (transformers >= 5.25; 5.24's
    adds it twice, and its sdpa path returns no probabilities)."""
    overrides = {}
    if name == "falcon":
        if Version(transformers.__version__) < Version("5.25"):
            pytest.skip("transformers < 5.25: Falcon's eager attention adds the ALiBi bias twice")
        overrides = {"attn_implementation": "eager"}
    model = _model(name, **overrides)
    ids, mask = _batch("left")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        patch(model)
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        assert model(input_ids=ids, attention_mask=mask).attentions is None
    for g, w in zip(got, want, strict=True):  # a left pad's row: 1/Lk on every key, as transformers shows it
        assert_rounding_close(g, w, n=LENGTH)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_unpatch_restores_exactly_and_state_is_unchanged(name, tmp_path):
    model = _model(name)
    ids, mask = _batch("left")
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        patch(model)
        assert model.state_dict().keys() == state.keys()
        model.save_pretrained(tmp_path)
        patched = model(input_ids=ids, attention_mask=mask).logits
        loaded = type(model).from_pretrained(tmp_path).eval()
        assert not is_alibi_patched(loaded)
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits, before)
        unpatch(model)
        assert not is_alibi_patched(model)
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    assert not torch.equal(patched, before)  # the patched path really ran (another rounding)


def test_copies_of_a_patched_model_after_generate_stay_patched():
    model = patch(_model("bloom"))
    ids, mask = _batch("left")
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
        want = model(input_ids=ids, attention_mask=mask).logits
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert is_alibi_patched(copied)
            assert torch.equal(copied(input_ids=ids, attention_mask=mask).logits, want)
            unpatch(copied)
            assert is_alibi_patched(model)


def test_falcon_bias_is_alibi_up_to_bfloat16_rounding_of_slope_times_position():
    """transformers rounds Falcon's position and slope x position to bfloat16: exact (ALiBi) below 256 tokens when
    the slopes are powers of two (1, 2, 4, 8 heads: the tests above use 4), off by at most 2^-7 of the product
    otherwise (32 heads, falcon-rw-1b's: from position 3), where relbias computes ALiBi exactly with the same slopes."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    positions = torch.arange(1024, dtype=torch.float64)
    for heads in (4, 8):
        alibi = build_alibi_tensor(torch.ones(1, 1024, dtype=torch.long), heads, torch.float32)[:, 0].double()
        exact = relbias.alibi_slopes(heads)[:, None] * positions
        assert torch.equal(alibi[:, :256], exact[:, :256]) and not torch.equal(alibi, exact)
    alibi = build_alibi_tensor(torch.ones(1, 1024, dtype=torch.long), 32, torch.float32)[:, 0].double()
    slopes = alibi_decoders._architecture("falcon").slopes(type("M", (), {"num_heads": 32})).double()
    exact = slopes[:, None] * positions
    assert torch.equal(alibi[:, :3], exact[:, :3]) and not torch.equal(alibi[:, :4], exact[:, :4])
    assert bool(((alibi - exact).abs() <= exact.abs() * 2.0**-7).all())


def test_slopes_are_the_models_own():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in (1, 3, 6, 12, 16, 20):
        assert torch.equal(alibi_decoders._architecture("bloom").slopes(type("M", (), {"num_heads": heads})),
                           _get_alibi_slopes(heads, torch.device("cpu")))
        for maximum in (8, 16, 5):
            want = -build_mpt_alibi_tensor(heads, 2, maximum)[:, 0, 0]
            assert torch.equal(relbias.mpt_alibi_slopes(heads, maximum), want)


def test_refusals_name_the_problem():
    rotary = transformers.FalconForCausalLM(transformers.FalconConfig(**{**_FALCON, "alibi": False}))
    with pytest.raises(TypeError, match="config.alibi=False"):
        patch(rotary)
    model = patch(_model("bloom"))
    with pytest.warns(UserWarning, match="already patched .* changes nothing"):
        patch_alibi(model)
    with pytest.raises(ValueError, match="already patched .*backend='reference'"):
        patch_alibi(model, backend="reference")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        patch_alibi(_model("mpt"), backend="nope")
    with pytest.raises(ValueError, match="not patched by relbias"):
        unpatch_alibi(_model("mpt"))
    with pytest.raises(TypeError, match="BLOOM, MPT and Falcon"):
        patch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_cached_steps_give_the_full_forward(name):
    """Prefill into a DynamicCache, then one token per step (transformers' MPT generate keeps no cache, so the steps
    are driven here): each step's logits are the patched full forward's at that position."""
    model = patch(_model(name))
    ids, mask = _batch("left")
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        cache = transformers.DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :30], attention_mask=mask[:, :30], cache=cache, use_cache=True).logits]
        for t in range(30, LENGTH):
            steps.append(model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache,
                               use_cache=True).logits)
        assert cache.get_seq_length() == LENGTH
    # A left pad's row is the mean of the values over its forward's keys: 30 in the prefill, 40 in the full one.
    _close(torch.cat(steps, dim=1), full, mask)
