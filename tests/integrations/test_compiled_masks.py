"""Under torch.compile, patched models hand transformers' mask to relbias::hf_masked_attention, which converts it
when the graph runs: the key padding form, which the fast backends take, wherever the eager conversion finds it,
and transformers' own results either way."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras)")

from relbias import T5Bias, attention  # noqa: E402
from relbias.backends import BACKENDS  # noqa: E402
from relbias.integrations.compiled_masks import (  # noqa: E402
    compiled_hf_attention, hf_masked_attention, hf_masked_attention_backward,
)
from relbias.integrations.masks import relbias_mask_from_hf  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, check_transformers_version  # noqa: E402
from relbias.integrations.transformers import patch  # noqa: E402

from .._cpu import assert_cpu_refusal, cpu_refusals  # noqa: E402
from .._tolerance import assert_rounding_close  # noqa: E402

try:
    check_transformers_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

MIN = torch.finfo(torch.float32).min
LENGTH, VOCAB = 24, 64


def _visible_masks(causal):
    """(name, bool (B, 1, L, L) visible) pairs: key padding ones and others."""
    keys = torch.ones(3, LENGTH, dtype=torch.bool)
    keys[1, :5] = False  # left padding
    keys[2, 7:9] = False  # a hole
    rule = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() if causal else torch.ones(LENGTH, LENGTH, dtype=torch.bool)
    padded = keys[:, None, None, :] & rule
    one_off = padded.clone()
    one_off[0, 0, 10, 3] = False  # one more hidden entry: no longer a key padding mask
    every_key = rule.expand(3, 1, LENGTH, LENGTH)
    all_padding = padded.clone()
    all_padding[1] = False  # a sequence that is all padding
    return [("padded", padded), ("one entry more", one_off), ("no padding", every_key),
            ("all padding", all_padding), ("not causal" if causal else "causal", padded & (~rule if causal else
                                                                                       rule.tril()))]


def _hf(visible, kind):
    """transformers' form of a visibility: the bool mask, or additive float (with other finite values)."""
    if kind == "bool":
        return visible
    hf = torch.zeros(visible.shape).masked_fill(~visible, MIN)
    if kind == "float with values":
        hf = hf + torch.where(visible, torch.linspace(-1.0, 1.0, visible.shape[-1]), 0.0)
    return hf


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float", "float with values"])
def test_the_compiled_op_equals_the_eager_conversion(causal, kind):
    """Compiled (one graph for every mask), the op gives what eager code gives: relbias.attention under
    relbias_mask_from_hf's form of the mask, whichever form that is (key padding, none, or the exact mask)."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, 4, LENGTH, 8, generator=generator) for _ in range(3))
    bias = T5Bias(4, num_buckets=8, max_distance=16, bidirectional=not causal)
    run = torch.compile(lambda q, k, v, mask: compiled_hf_attention(
        q, k, v, mask, bias=bias, is_causal=causal, query_start=0, scale=None, convention="t5", backend=None,
        dropout_p=0.0), fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        for name, visible in _visible_masks(causal):
            hf = _hf(visible, kind)
            mask, is_causal = relbias_mask_from_hf(hf, is_causal=causal)
            want = attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal, convention="t5")
            assert_rounding_close(run(query, key, value, hf), want, n=LENGTH), name
    torch._dynamo.reset()


def test_no_op_outside_compile_for_tensor_positions_or_several_mask_heads():
    """Eager calls convert the mask themselves (relbias_mask_from_hf); a compiled graph that reads a tensor query
    position (a static cache's decoding step), a mask of several heads or the structured backend keeps the exact
    mask; gradients and dropout take the op."""
    query = torch.randn(1, 2, 4, 8)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    bias = T5Bias(2, num_buckets=8, max_distance=16)

    def run(mask, query_start, dropout_p=0.0, backend=None):
        return compiled_hf_attention(query, query, query, mask, bias=bias, is_causal=False, query_start=query_start,
                                     scale=None, convention="t5", backend=backend, dropout_p=dropout_p)

    assert run(mask, 0) is None
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    assert compiled(mask, 0) is not None  # the bias's table requires a gradient, and grad mode is on
    assert compiled(mask, 0, 0.1) is not None
    with torch.no_grad():
        assert compiled(mask, 0) is not None
        assert compiled(mask, torch.tensor(0)) is None
        assert compiled(mask.expand(1, 2, 4, 4), 0) is None
        assert compiled(mask, 0, 0.0, "structured") is None  # reads a family's far-constant distance: not the op's
    torch._dynamo.reset()


def test_opcheck():
    """torch.library.opcheck of relbias::hf_masked_attention and its backward (schema, fake implementations,
    dispatch, the autograd registration), with and without a per-key bias, dropout and inputs requiring grad."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 6, 8, generator=generator) for _ in range(3))
    visible = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    visible[1, ..., :2] = False
    values = torch.randn(4, 11, generator=generator)
    for mask in (visible, _hf(visible, "float with values")):
        for key_bias in (None, torch.randn(2, 4, 1, 6, generator=generator)):
            for dropout_p, grad in ((0.0, False), (0.0, True), (0.3, True)):
                tensors = [t.clone().requires_grad_(grad) for t in (query, key, value)]
                offsets = values.clone().requires_grad_(grad)
                per_key = None if key_bias is None else key_bias.clone().requires_grad_(grad)
                settings = (0, True, False, None, "t5", "auto", False, dropout_p, torch.tensor(11))
                torch.library.opcheck(hf_masked_attention, (*tensors, mask, offsets, per_key, *settings))
                if grad:
                    grad_out = torch.randn(2, 4, 6, 8, generator=generator)
                    torch.library.opcheck(hf_masked_attention_backward,
                                          (grad_out, query, key, value, mask, values, key_bias, *settings))


def _mpnet(head_dim: int = 8):
    config = transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=4 * head_dim, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64)
    return transformers.MPNetModel(config)


def _t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


MODELS = {
    "mpnet": _mpnet,
    "t5": _t5,
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48,
                                                                            n_layer=2, n_head=6)),
    "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(vocab_size=VOCAB, d_model=48, n_layers=2,
                                                                      n_heads=6, max_seq_len=64)),
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, bias=True,
        new_decoder_architecture=False, multi_query=False, parallel_attn=False)),
}


def _output(model, ids, mask):
    if isinstance(getattr(model, "_orig_mod", model), transformers.T5ForConditionalGeneration):  # the decoder reads the padded encoder output
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids, decoder_attention_mask=mask).logits
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _ran_toeplitz(run, monkeypatch) -> tuple[torch.Tensor, bool]:
    """``run()``'s result and whether the toeplitz backend ran in it."""
    ran = []
    toeplitz = BACKENDS["toeplitz"]
    real = toeplitz.forward
    monkeypatch.setattr(toeplitz, "forward", lambda call: ran.append(True) or real(call))
    out = run()
    monkeypatch.undo()
    return out, bool(ran)


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_patched_models_take_the_key_padding_form(name, monkeypatch):
    """A compiled (fullgraph) patched model in inference gives transformers' eager outputs for a left-padded batch,
    a batch with holes in its padding and one with none, from one graph, and runs the toeplitz kernel for each;
    except, for BLOOM and Falcon, which count positions over visible tokens (offsets stand for them for one run of
    visible keys only), the batch with holes, which runs their own per-key bias with the exact mask."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    patched = patch(copy.deepcopy(model))
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager", dynamic=False)
    ids = torch.randint(2, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(3, LENGTH, dtype=torch.long)
    padded[1, :5] = 0  # left padding
    holes = padded.clone()
    holes[2, 7:9] = 0
    counted = name in ("bloom", "falcon")
    with torch.no_grad():
        for mask, fast in ((padded, True), (holes, not counted), (torch.ones_like(padded), True)):
            want = _output(model, ids, mask)
            got, ran = _ran_toeplitz(lambda: _output(compiled, ids, mask), monkeypatch)
            keep = mask.bool()[..., None].expand_as(got)  # a query of a left pad sees no key: transformers' mean
            assert_rounding_close(got[keep], want[keep], n=LENGTH)
            assert ran == fast
    torch._dynamo.reset()


def _train_step(model, ids, mask, seed):
    """(loss, {name: gradient}) of one training step's forward and backward from torch's global seed ``seed``."""
    torch.manual_seed(seed)
    out = _output(model, ids, mask)
    loss = (out * torch.linspace(-1.0, 1.0, out.shape[-1])).mean()
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_patched_models_train_as_eager_on_the_fused_kernels(name, monkeypatch):
    """A compiled (aot_eager, fullgraph) patched model in training mode on a left-padded batch: the loss and every
    parameter's gradient equal the eager patched model's, and the toeplitz kernel runs in the forward and again in
    the backward (the op's recomputation) rather than blockwise on the whole mask."""
    torch.manual_seed(0)
    patched = patch(MODELS[name]()).train()
    ids = torch.randint(2, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, LENGTH, dtype=torch.long)
    mask[1, :5] = 0
    want = _train_step(copy.deepcopy(patched), ids, mask, seed=3)
    compiled = copy.deepcopy(patched)
    calls = []
    toeplitz = BACKENDS["toeplitz"]
    real = toeplitz.forward
    monkeypatch.setattr(toeplitz, "forward", lambda call: calls.append(call.needs_grad) or real(call))
    step = torch.compile(compiled, fullgraph=True, backend="aot_eager", dynamic=False)
    loss, grads = _train_step(step, ids, mask, seed=3)
    monkeypatch.undo()
    assert False in calls and True in calls  # the forward (nothing recorded) and the backward's recomputation
    assert_rounding_close(loss, want[0], n=LENGTH)
    assert want[1].keys() <= grads.keys()
    for key in grads:  # a parameter the output does not use (MPNet's pooler): zeros compiled, None eager
        assert_rounding_close(grads[key], want[1].get(key, torch.zeros_like(grads[key])), n=3 * LENGTH, msg=key)
    torch._dynamo.reset()


def test_a_compiled_patched_t5_with_dropout_trains_as_eager(monkeypatch):
    """T5's dropout (0.1) on a padded batch, compiled: the op draws the mask seed eager code draws (and the backward
    drops the same entries), so loss and gradients equal eager's, under aot_eager and under inductor drawing eager's
    random numbers (``fallback_random``)."""
    import torch._inductor.config as inductor_config

    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.1, decoder_start_token_id=0)
    torch.manual_seed(0)
    patched = patch(transformers.T5ForConditionalGeneration(config)).train()
    ids = torch.randint(2, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, LENGTH, dtype=torch.long)
    mask[1, :5] = 0
    want = _train_step(copy.deepcopy(patched), ids, mask, seed=3)
    toeplitz = BACKENDS["toeplitz"]
    real = toeplitz.forward
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        dropped = []
        monkeypatch.setattr(toeplitz, "forward", lambda call: dropped.append(call.dropout is not None) or real(call))
        with inductor_config.patch(fallback_random=True):
            step = torch.compile(copy.deepcopy(patched), fullgraph=True, backend=backend, dynamic=False)
            loss, grads = _train_step(step, ids, mask, seed=3)
        monkeypatch.undo()
        assert dropped and all(dropped), backend  # the padded calls ran the fused kernels, with dropout
        assert_rounding_close(loss, want[0], n=LENGTH, msg=backend)
        for key in grads:
            assert_rounding_close(grads[key], want[1][key], n=3 * LENGTH, msg=f"{backend} {key}")
    torch._dynamo.reset()


@pytest.mark.parametrize("head_dim", [8, 32])
def test_the_op_runs_flex_on_a_compiled_graphs_first_call(head_dim):
    """PyTorch runs a compiled graph's custom ops once under a dispatch mode (its aliasing check); the op's work runs
    as eager code there: flex (whose block masks use vmap, and whose one-time self-test compiles FlexAttention) gives
    the eager result on the first and later calls, and eager flex calls still run afterwards. Head dim 32 runs on
    every CPU; head dim 8 is refused by name below AVX-512 (flex's guard), and runs on AVX-512. Without a vector ISA
    for inductor (ATEN_CPU_CAPABILITY=default) FlexAttention does not compile: refused by name."""
    torch.manual_seed(0)
    model = _mpnet(head_dim).eval()
    patched = patch(copy.deepcopy(model), backend="flex")
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager", dynamic=False)
    ids = torch.randint(2, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    query = torch.empty(3, 4, 10, head_dim)
    if cpu_refusals("flex", query):
        with torch.no_grad(), pytest.raises(ValueError, match="backend 'flex' cannot run this call") as refused:
            patched(input_ids=ids, attention_mask=mask)
        assert assert_cpu_refusal("flex", str(refused.value), query)
        torch._dynamo.reset()
        return
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for _ in range(2):
            assert_rounding_close(compiled(input_ids=ids, attention_mask=mask).last_hidden_state, want, n=10)
        assert_rounding_close(patched(input_ids=ids, attention_mask=mask).last_hidden_state, want, n=10)
    torch._dynamo.reset()


def test_a_compiled_patched_model_takes_any_4d_mask_exactly(monkeypatch):
    """A 4D mask handed to the model itself (not a padding mask) runs the exact mask in the same compiled graph."""
    torch.manual_seed(0)
    model = _mpnet().eval()
    compiled = torch.compile(patch(copy.deepcopy(model)), fullgraph=True, backend="aot_eager", dynamic=False)
    ids = torch.randint(2, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    visible = torch.ones(2, 1, LENGTH, LENGTH, dtype=torch.bool)
    visible[0, 0, 3, 5] = False
    visible[1, 0, :, 20:] = False
    mask = torch.zeros(visible.shape).masked_fill(~visible, MIN)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got, ran = _ran_toeplitz(lambda: compiled(input_ids=ids, attention_mask=mask).last_hidden_state,
                                 monkeypatch)
    assert_rounding_close(got, want, n=LENGTH)
    assert not ran
    torch._dynamo.reset()
