"""patch_t5 / unpatch_t5: T5, mT5 and UMT5 models give transformers' own outputs through relbias attention."""

import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from relbias import T5Bias  # noqa: E402
from relbias.backends import BACKENDS  # noqa: E402
from relbias.integrations import t5_attention as integration  # noqa: E402
from relbias.integrations.common import check_transformers_version as _check_version  # noqa: E402
from relbias.integrations.transformers import (  # noqa: E402
    SUPPORTED_TRANSFORMERS,
    is_patched,
    patch_t5,
    unpatch_t5,
)

from .._tolerance import assert_rounding_close  # noqa: E402

try:
    _check_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

FAMILIES = ["t5", "mt5", "umt5"]
#: The longest sum in the tiny models (tests/integrations/conftest.py): d_ff = 64 features (keys: at most 40).
N_SUM = 64


def close(got, want):
    """relbias attention against transformers' (other kernels, other summation orders) through a 2-layer model:
    equal to float32 rounding of its longest sum, scaled by the compared tensor's magnitude (tests/_tolerance.py)."""
    assert_rounding_close(got, want, n=N_SUM)


def patched_and_plain(hf, family, kind="ForConditionalGeneration", **kwargs):
    """Two identical models; the first patched."""
    return patch_t5(hf.tiny_model(family, kind, **kwargs)), hf.tiny_model(family, kind, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    """Records what the patched layers pass to relbias.attention, which then computes as usual."""
    calls = []
    real = integration.attention

    def recording(query, key, value, **kwargs):
        calls.append(dict(kwargs, query_len=query.shape[2], key_len=key.shape[2], batch=query.shape[0]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(integration, "attention", recording)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_model_with_padding(hf, family):
    patched, plain = patched_and_plain(hf, family, "EncoderModel")
    input_ids, attention_mask = hf.batch(batch_size=3, length=40, pad_last=13)
    with torch.no_grad():
        close(patched(input_ids, attention_mask=attention_mask).last_hidden_state,
              plain(input_ids, attention_mask=attention_mask).last_hidden_state)
        close(patched(input_ids).last_hidden_state, plain(input_ids).last_hidden_state)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_seq2seq_forward_with_padding(hf, family, attn_implementation):
    patched, plain = patched_and_plain(hf, family, attn_implementation=attn_implementation)
    input_ids, attention_mask = hf.batch(length=40, pad_last=9)
    decoder_input_ids, decoder_attention_mask = hf.batch(length=30, pad_last=7, seed=2)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                  decoder_attention_mask=decoder_attention_mask, use_cache=False)
    with torch.no_grad():
        got, want = patched(**inputs), plain(**inputs)
    close(got.encoder_last_hidden_state, want.encoder_last_hidden_state)
    close(got.logits, want.logits)


def test_left_padded_decoder_matches_at_every_token(hf):
    """A left-padded decoder row's first queries see no key: the patch gives them transformers' mean of the values
    (relbias.attention alone gives zeros), so the pads' outputs match too."""
    patched, plain = patched_and_plain(hf, "t5")
    input_ids, attention_mask = hf.batch(length=40)
    decoder_ids, _ = hf.batch(length=20, seed=2)
    decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask[1, :6] = 0
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids,
                  decoder_attention_mask=decoder_mask, use_cache=False)
    with torch.no_grad():
        got, want = patched(**inputs).logits, plain(**inputs).logits
    close(got, want)


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_decoder_with_cache_matches_plain_and_full_forward(hf, family):
    """Prefill 25 decoder tokens, then decode 5 one at a time from the cache; compare every step."""
    patched, plain = patched_and_plain(hf, family, "Model")
    input_ids, attention_mask = hf.batch(length=40, pad_last=6)
    decoder_ids, _ = hf.batch(length=30, seed=3)
    with torch.no_grad():
        full = patched(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids,
                       use_cache=False).last_hidden_state
        for model in (patched, plain):
            out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids[:, :25], use_cache=True)
            steps, cache = [out.last_hidden_state], out.cache
            for t in range(25, 30):
                out = model(encoder_outputs=(out.encoder_last_hidden_state,), attention_mask=attention_mask,
                            decoder_input_ids=decoder_ids[:, t:t + 1], cache=cache, use_cache=True)
                steps.append(out.last_hidden_state)
                cache = out.cache
            model.steps = torch.cat(steps, dim=1)
    close(patched.steps, plain.steps)
    close(patched.steps, full)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_tokens(hf, family):
    patched, plain = patched_and_plain(hf, family, initializer_factor=5.0, bias_scale=1.0)
    input_ids, attention_mask = hf.batch(length=40, pad_last=11)
    settings = dict(attention_mask=attention_mask, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with torch.no_grad():
        got, want = patched.generate(input_ids, **settings), plain.generate(input_ids, **settings)
    assert torch.equal(got, want)
    assert got.shape[1] == 25 and len(set(got[0].tolist())) > 3  # the model does not just repeat one token


def test_static_cache_generation(hf):
    patched, plain = patched_and_plain(hf, "t5", initializer_factor=5.0, bias_scale=1.0)
    input_ids, attention_mask = hf.batch(length=20)
    settings = dict(attention_mask=attention_mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                    cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(patched.generate(input_ids, **settings), plain.generate(input_ids, **settings))


@pytest.mark.parametrize(
    "family, attn_implementation, compiler",
    [("t5", "sdpa", "inductor"), ("umt5", "eager", "aot_eager")],  # umt5: a table per layer; eager: float masks
)
def test_compiled_static_cache_generation(hf, family, attn_implementation, compiler):
    """generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True)): the static cache's
    tensor past_seen_tokens stays a tensor in the compiled decoding step, so it compiles whole, once for every
    step (and a second prompt of the same shape recompiles nothing), and gives unpatched tokens."""
    settings = dict(initializer_factor=5.0, bias_scale=1.0, attn_implementation=attn_implementation)
    patched, plain = patched_and_plain(hf, family, **settings)
    input_ids, attention_mask = hf.batch(length=12, pad_last=3)
    compile_config = hf.transformers.CompileConfig(fullgraph=True, backend=compiler)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only otherwise (as its own tests do)
    steps = dict(attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    other_ids = hf.batch(length=12, pad_last=3, seed=5)[0]
    try:
        with torch.no_grad():
            got = patched.generate(input_ids, cache_implementation="static", compile_config=compile_config, **steps)
            compiled_graphs = counters["stats"]["unique_graphs"] - before
            with torch.compiler.set_stance("fail_on_recompile"):
                got_other = patched.generate(other_ids, cache_implementation="static", compile_config=compile_config,
                                             **steps)
            want = plain.generate(input_ids, cache_implementation="static", **steps)
            want_other = plain.generate(other_ids, cache_implementation="static", **steps)
    finally:
        torch._dynamo.reset()
    assert compiled_graphs == 1  # the decoding step, compiled whole once: not skipped, not once per position
    assert torch.equal(got, want) and torch.equal(got_other, want_other)
    assert got.shape[1] == 7 and len(set(got[0].tolist())) > 2  # the model does not just repeat one token
    assert not torch.equal(got, got_other)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_match(hf, checkpointing):
    patched, plain = patched_and_plain(hf, "t5")
    input_ids, attention_mask = hf.batch(length=24, pad_last=5)
    labels, _ = hf.batch(length=12, seed=4)
    for model in (patched, plain):
        model.train()  # dropout_rate is 0
        if checkpointing:
            hf.enable_checkpointing(model)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    for (name, got), (_, want) in zip(patched.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert patched.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad.abs().sum() > 0


def test_patched_path_carries_modules_and_compact_masks(hf, spy, monkeypatch):
    """No (1, H, Lq, Lk) bias: compute_bias of the class is never called, and relbias gets T5Bias + key padding."""
    model = patch_t5(hf.tiny_model("t5"), backend="reference")

    def forbidden(*args, **kwargs):
        raise AssertionError("the patched path must not materialise transformers' position bias")

    monkeypatch.setattr(hf.transformers.models.t5.modeling_t5.T5Attention, "compute_bias", forbidden)
    input_ids, attention_mask = hf.batch(length=40, pad_last=9)
    decoder_ids, decoder_mask = hf.batch(length=30, pad_last=4, seed=2)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids,
              decoder_attention_mask=decoder_mask, use_cache=False)
    assert len(spy) == 4  # 2 encoder + 2 decoder self-attention layers; cross-attention stays transformers'
    tables = {id(m.weight) for m in (model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias,
                                     model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias)}
    for call, causal in zip(spy, (False, False, True, True)):
        assert isinstance(call["bias"], T5Bias) and id(call["bias"].weight) in tables
        assert call["bias"].bidirectional is not causal and call["is_causal"] is causal
        assert call["mask"].shape == (2, 1, 1, call["key_len"]) and call["mask"].dtype == torch.bool
        assert call["convention"] == "t5" and call["backend"] == "reference" and call["query_start"] == 0
    assert spy[0]["bias"] is spy[1]["bias"]  # T5: one module shared by the stack's layers
    assert spy[0]["mask"] is spy[1]["mask"]  # the stack's mask is converted once per forward


def test_default_backend_is_relbias_default(hf, spy):
    """backend=None leaves the choice to relbias.attention's default ("auto" once the dispatcher is there)."""
    model = patch_t5(hf.tiny_model("t5", "EncoderModel"))
    input_ids, _ = hf.batch(length=10)
    with torch.no_grad():
        model(input_ids)
    assert len(spy) == 2 and all("backend" not in call and call["mask"] is None for call in spy)


def test_unpatch_restores_exactly(hf):
    model = hf.tiny_model("umt5")
    attention = model.decoder.block[1].layer[0].SelfAttention
    before_dict, before_config = dict(attention.__dict__), attention.config
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    input_ids, attention_mask = hf.batch(length=20, pad_last=3)
    with torch.no_grad():
        want = model(input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :7]).logits
        patch_t5(model)
        assert is_patched(model) and attention.config is not before_config and "compute_bias" in attention.__dict__
        assert model.state_dict().keys() == before_state.keys()
        unpatch_t5(model)
        got = model(input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :7]).logits
    assert not is_patched(model) and attention.__dict__ == before_dict and attention.config is before_config
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
    assert torch.equal(got, want)


def test_table_changes_reach_the_patched_model(hf):
    """The relbias module shares the model's parameter: editing the table changes the patched outputs alike."""
    patched, plain = patched_and_plain(hf, "t5", "EncoderModel")
    input_ids, _ = hf.batch(length=30)
    with torch.no_grad():
        before = patched(input_ids).last_hidden_state
        for model in (patched, plain):
            model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(-1)
        after = patched(input_ids).last_hidden_state
        close(after, plain(input_ids).last_hidden_state)
    assert (after - before).abs().max() > 1e-2


def test_errors(hf, monkeypatch):
    model = hf.tiny_model("t5")
    from relbias.integrations.longt5 import patch_longt5
    from relbias.integrations.mpnet import patch_mpnet
    from relbias.integrations.transformers import patch, unpatch

    for function in (patch, unpatch, patch_t5, unpatch_t5, patch_longt5, patch_mpnet):
        with pytest.raises(TypeError, match=r"expected a torch.nn.Module \(the model, not its name: load it first, "
                                            r"e.g. transformers.AutoModelForSeq2SeqLM.from_pretrained\('t5-small'\)"):
            function("t5-small")
    with pytest.raises(TypeError, match="expected a torch.nn.Module .*got dict"):
        patch({"model": model})
    with pytest.raises(TypeError, match="found no T5-family stack in Linear"):
        patch_t5(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        patch_t5(model, backend="nope")
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        patch_t5(hf.tiny_model("t5", attn_implementation="flex_attention"))
    with pytest.raises(ValueError, match="not patched"):
        unpatch_t5(model)
    patch_t5(model)
    with pytest.warns(UserWarning, match="already patched .* changes nothing"):
        patch_t5(model)
    with pytest.raises(ValueError, match="already patched .*backend='reference'"):
        patch_t5(model, backend="reference")
    with pytest.raises(TypeError, match="needs the relbias position bias"):
        q = torch.zeros(1, 4, 3, 8)
        integration.relbias_t5_attention(model.encoder.block[0].layer[0].SelfAttention, q, q, q, None,
                                         position_bias=torch.zeros(1, 4, 3, 3))


def test_unsupported_transformers_version(hf, monkeypatch):
    model = hf.tiny_model("t5")
    # sys.modules, not hf.transformers: building a flex-attention model rebinds the top-level module object.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.3")
    with pytest.raises(RuntimeError, match=r"transformers 4.46.3 is installed.*>=5.24,<6"):
        patch_t5(model)
    assert not is_patched(model)


@pytest.mark.parametrize("backend", [name for name in BACKENDS if name != "reference"])
def test_memory_lean_backends(hf, backend):
    """The same outputs through relbias' tiled / structured / flex backends (a bias-free-mask call for structured)."""
    patched, plain = patched_and_plain(hf, "t5")
    patch_t5(unpatch_t5(patched), backend=backend)
    input_ids, attention_mask = hf.batch(length=40, pad_last=0 if backend != "blockwise" else 9)
    decoder_ids, _ = hf.batch(length=30, seed=2)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids)
    with torch.no_grad():
        try:
            got = patched(**inputs, use_cache=False)
        except ValueError as exc:  # a backend that cannot run here says why (e.g. flex needs a compiler)
            pytest.skip(f"backend {backend!r} unavailable: {exc}")
        want = plain(**inputs, use_cache=False)
    close(got.encoder_last_hidden_state, want.encoder_last_hidden_state)
    close(got.logits, want.logits)
