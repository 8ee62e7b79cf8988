"""relbias modules behave like any torch module after any call: after a training step (forward and backward), a
decoding step and generation, ``copy.deepcopy``, ``pickle``, ``torch.save`` / ``torch.load`` of the whole module,
``torch.optim.swa_utils.AveragedModel`` and a ``state_dict`` round trip all work, and every copy computes exactly
what the original computes (the same call on the same backend runs the same code: ``torch.equal``).

Covered: every bias family on every backend that runs the calls, ``relbias.nn.MultiheadAttention`` with its KV cache,
and a Hugging Face T5 patched by ``relbias.integrations.transformers.patch_t5`` (also where relbias never patched a
model in the process that loads it, and a bias loaded onto the meta device, then materialised and loaded).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import relbias
from relbias.backends import BACKENDS
from relbias.biases import FAMILIES, make_bias
from relbias.nn import KVCache, MultiheadAttention

from .hardening._cases import build_bias

HEADS, HEAD_DIM = 4, 16
#: The training call's length, and the decoding step's keys (one query, on the last of them).
TRAIN_LEN, DECODE_KEYS = 12, 40
#: Longest length the biases are built for (a per-offset table's rows).
MAX_LEN = 48
#: Families that build a module ("none" builds None: no bias, nothing to copy).
BIAS_FAMILIES = [name for name in FAMILIES if make_bias(name, num_heads=1, max_len=8, bidirectional=False) is not None]
COPY_WAYS = ("deepcopy", "pickle", "torch.save", "AveragedModel", "state_dict")


def _saved_and_loaded(obj: object, **load_kwargs: object) -> object:
    """``obj`` through ``torch.save`` and ``torch.load`` (in memory)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load_kwargs)


def _copies(module: torch.nn.Module, fresh: torch.nn.Module, prepare_fresh=None) -> dict[str, torch.nn.Module]:
    """``module`` copied in the five ways, by name. ``fresh``: a module of the same configuration that receives
    ``module``'s state dict (saved and loaded as a checkpoint, ``weights_only=True``), then ``prepare_fresh(fresh)``
    when given (e.g. patching a model)."""
    averaged = AveragedModel(module)
    averaged.update_parameters(module)  # the first update writes the parameters in place (new version counters)
    incompatible = fresh.load_state_dict(_saved_and_loaded(module.state_dict(), weights_only=True))
    assert not incompatible.missing_keys and not incompatible.unexpected_keys, incompatible
    if prepare_fresh is not None:
        fresh = prepare_fresh(fresh)
    copies = {
        "deepcopy": copy.deepcopy(module),
        "pickle": pickle.loads(pickle.dumps(module)),
        "torch.save": _saved_and_loaded(module, weights_only=False),
        "AveragedModel": averaged.module,
        "state_dict": fresh,
    }
    assert tuple(copies) == COPY_WAYS
    for name, other in copies.items():
        assert other is not module, name
        assert type(other) is type(module), name
        ours = {t.data_ptr() for t in (*module.parameters(), *module.buffers()) if t.numel()}
        assert not ours & {t.data_ptr() for t in (*other.parameters(), *other.buffers()) if t.numel()}, (
            f"{name}: the copy shares storage with the original"
        )
    return copies


def _assert_same_results(got: dict, want: dict, what: str) -> None:
    """Every call's output and gradients bit-identical (None where the original's gradient is None)."""
    assert got.keys() == want.keys(), what
    for call, (out, grads) in want.items():
        other_out, other_grads = got[call]
        assert torch.equal(other_out, out), f"{what}, {call}: output differs by {(other_out - out).abs().max()}"
        assert len(other_grads) == len(grads), f"{what}, {call}"
        for i, (a, b) in enumerate(zip(other_grads, grads)):
            assert (a is None) == (b is None), f"{what}, {call}: gradient {i}"
            assert b is None or torch.equal(a, b), f"{what}, {call}: gradient {i} differs by {(a - b).abs().max()}"


# --------------------------------------------------------------------------------------------------- bias modules


def _bias_inputs() -> dict[str, tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)

    def draw(length):
        return tuple(torch.randn(1, HEADS, length, HEAD_DIM, generator=generator) for _ in range(3))

    train, decode = draw(TRAIN_LEN), draw(DECODE_KEYS)
    return {"train": train, "decode": (decode[0][:, :, -1:], decode[1], decode[2])}


def _runnable_calls(bias, backend: str, inputs: dict) -> tuple[dict[str, bool], list[str]]:
    """Which calls ``backend`` runs, by name -> with gradients: "train" (with gradients, else forward only under
    no_grad) and "decode" (no_grad); and the refusals' reasons."""
    runnable, refusals = {}, []
    for call, grad_modes in (("train", (True, False)), ("decode", (False,))):
        q, k, v = inputs[call]
        for grad in grad_modes:
            qkv = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            with torch.set_grad_enabled(grad):
                try:
                    relbias.explain_backend(*qkv, bias=bias, is_causal=True, backend=backend)
                except ValueError as exc:
                    refusals.append(f"{call} (grad={grad}): {exc}")
                    continue
            runnable[call] = grad
            break
    return runnable, refusals


def _bias_results(bias, backend: str, inputs: dict, runnable: dict[str, bool]) -> dict:
    """call -> (output, gradients of sum(output * w) w.r.t. q, k, v and the bias's parameters, or ())."""
    results = {}
    for call, grad in runnable.items():
        qkv = [t.detach().clone().requires_grad_(grad) for t in inputs[call]]
        with torch.set_grad_enabled(grad):
            out = relbias.attention(*qkv, bias=bias, is_causal=True, backend=backend)
        grads = ()
        if grad:
            weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
            grads = torch.autograd.grad((out * weights).sum(), [*qkv, *bias.parameters()], allow_unused=True)
        results[call] = (out.detach(), grads)
    return results


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", BIAS_FAMILIES)
def test_bias_copies_after_a_training_step_and_a_decoding_step_compute_the_same(family, backend, small_tiles):
    # small_tiles: several tiles per call, and FlexAttention eager (the same score_mod, no compilation per shape)
    bias = build_bias(family, num_heads=HEADS, bidirectional=False, max_len=MAX_LEN)
    inputs = _bias_inputs()
    runnable, refusals = _runnable_calls(bias, backend, inputs)
    if not runnable:
        pytest.skip(f"{backend} runs neither call: {'; '.join(refusals)}")
    # the calls that fill whatever a module keeps between calls (native-form memo, checks, tables), then a training
    # step's backward through the bias parameters (on "auto" where this backend refuses gradients)
    want = _bias_results(bias, backend, inputs, runnable)
    qkv = [t.detach().clone().requires_grad_() for t in inputs["train"]]
    out = relbias.attention(*qkv, bias=bias, is_causal=True, backend=backend if runnable.get("train") else "auto")
    out.square().sum().backward()
    assert all(t.grad is not None for t in qkv) and all(p.grad is not None for p in bias.parameters())

    fresh = build_bias(family, num_heads=HEADS, bidirectional=False, max_len=MAX_LEN)
    copies = _copies(bias, fresh)
    _assert_same_results(_bias_results(bias, backend, inputs, runnable), want, "the original after copying")
    for way, other in copies.items():
        _assert_same_results(_bias_results(other, backend, inputs, runnable), want, f"{family}/{backend}/{way}")
    # a copy's results are its own: changing a copy's parameters changes its decoding step, not the original's
    other = copies["deepcopy"]
    if "decode" in runnable and any(True for _ in other.parameters()):
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.5 + p.abs())
        changed = _bias_results(other, backend, inputs, {"decode": False})["decode"][0]
        assert not torch.equal(changed, want["decode"][0])
        _assert_same_results(_bias_results(bias, backend, inputs, runnable), want, "the original")


def test_t5_bias_loaded_onto_the_meta_device_then_materialised_computes_what_the_original_computes():
    """A whole module saved after a call, loaded with ``map_location="meta"``, materialised (``to_empty``) and given
    the original's state dict: the usual way to load a large model without allocating it twice. Uninitialised memory
    is filled with NaN while the loaded module computes (deterministic mode), so that a read of it cannot pass by
    chance (freed memory holding the very values expected)."""
    bias = relbias.T5Bias(HEADS, num_buckets=8, max_distance=16, bidirectional=False)
    q, k, v = _bias_inputs()["decode"]
    with torch.no_grad():
        relbias.attention(q, k, v, bias=bias, is_causal=True)  # fills what the module keeps per device
    loaded = _saved_and_loaded(bias, weights_only=False, map_location="meta")
    loaded = loaded.to_empty(device="cpu")
    loaded.load_state_dict(bias.state_dict())
    offsets = torch.arange(-DECODE_KEYS, DECODE_KEYS)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            values = loaded.offset_values(offsets)
            got = relbias.attention(q, k, v, bias=loaded, is_causal=True)
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    with torch.no_grad():
        assert torch.equal(values, bias.offset_values(offsets))
        want = relbias.attention(q, k, v, bias=bias, is_causal=True)
    assert torch.equal(got, want), f"differs by {(got - want).abs().max()}"


# ------------------------------------------------------------------------------------------ MultiheadAttention

EMBED = HEADS * 8


def _layer() -> MultiheadAttention:
    bias = relbias.T5Bias(HEADS, num_buckets=8, max_distance=16, bidirectional=False)
    with torch.no_grad():
        bias.weight.mul_(20.0)  # a bias that weighs as much as q.k, so a wrong position shows
    return MultiheadAttention(EMBED, HEADS, batch_first=True, position_bias=bias, is_causal=True)


def _layer_results(layer: MultiheadAttention, x: torch.Tensor, cache: KVCache) -> dict:
    """A training forward (output; gradients w.r.t. the input and every parameter), a decoding run with a new cache
    (a prefill of all tokens but one, then one step), and one more step continuing from a copy of ``cache``."""
    results = {}
    x_grad = x.detach().clone().requires_grad_()
    out, _ = layer(x_grad, need_weights=False)
    weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), [x_grad, *layer.parameters()], allow_unused=True)
    results["train"] = (out.detach(), grads)
    with torch.no_grad():
        new_cache = KVCache()
        prefill, _ = layer(x[:, :-1], need_weights=False, cache=new_cache)
        step, _ = layer(x[:, -1:], need_weights=False, cache=new_cache)
        results["prefill"], results["step"] = (prefill, ()), (step, ())
        more = x[:, -1:].flip(0)  # a token after the cached ones
        results["continue"] = (layer(more, need_weights=False, cache=copy.deepcopy(cache))[0], ())
    return results


def test_multihead_attention_copies_after_training_and_decoding_compute_the_same():
    layer = _layer()
    x = torch.randn(2, TRAIN_LEN, EMBED, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    out, _ = layer(x, need_weights=False)  # a training step
    out.square().mean().backward()
    optimizer.step()
    assert layer.position_bias.weight.grad is not None and bool(layer.position_bias.weight.grad.abs().sum() > 0)
    cache = KVCache()
    with torch.no_grad():  # incremental decoding, token by token
        for t in range(TRAIN_LEN):
            layer(x[:, t : t + 1], need_weights=False, cache=cache)
    assert cache.length == TRAIN_LEN

    want = _layer_results(layer, x, cache)
    copies = _copies(layer, _layer())
    _assert_same_results(_layer_results(layer, x, cache), want, "the original after copying")
    for way, other in copies.items():
        assert isinstance(other.position_bias, relbias.T5Bias), way
        _assert_same_results(_layer_results(other, x, cache), want, f"MultiheadAttention/{way}")
        # the copy's bias is its own module, the one its parameters list
        assert other.position_bias.weight is dict(other.named_parameters())["position_bias.weight"], way
    with torch.no_grad():
        copies["pickle"].position_bias.weight.mul_(-1.0)
    assert not torch.equal(_layer_results(copies["pickle"], x, cache)["step"][0], want["step"][0])
    _assert_same_results(_layer_results(layer, x, cache), want, "the original")


# ------------------------------------------------------------------------------------ Hugging Face T5, patched

T5_VOCAB = 100


def _t5_model(seed: int):
    transformers = pytest.importorskip("transformers")
    integration = pytest.importorskip("relbias.integrations.transformers")
    try:
        integration.check_transformers_version()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    config = transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=T5_VOCAB, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # bias tables that weigh as much as q.k, and varied greedy tokens
        for name, parameter in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                parameter.mul_(10.0)
    return model


def _t5_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(2, T5_VOCAB, (2, 14), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -4:] = 0  # padding in the second row
    input_ids[1, -4:] = 0
    return input_ids, attention_mask


def _t5_results(model, input_ids, attention_mask) -> dict:
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        tokens = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    return {"encoder": (encoded, ()), "generate": (tokens, ())}


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the patched layers' calls of relbias.attention (which then computes as usual)."""
    integration = pytest.importorskip("relbias.integrations.t5_attention")
    calls = []
    real = integration.attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "attention", counting)
    return calls


def test_patched_t5_copies_after_training_and_generation_compute_the_same(attention_calls):
    model = _t5_model(0)  # skips without a supported transformers
    from relbias.integrations.transformers import is_patched, patch_t5

    patch_t5(model)
    input_ids, attention_mask = _t5_batch()
    labels = torch.randint(2, T5_VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()  # a training step
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)

    want = _t5_results(model, input_ids, attention_mask)
    tokens = want["generate"][0]
    assert tokens.shape == (2, 6) and len(set(tokens[:, 1:].flatten().tolist())) > 1, tokens  # not one token repeated
    fresh = _t5_model(1)
    assert not torch.equal(_t5_results(fresh, input_ids, attention_mask)["encoder"][0], want["encoder"][0])
    copies = _copies(model, fresh, prepare_fresh=patch_t5)
    _assert_same_results(_t5_results(model, input_ids, attention_mask), want, "the original after copying")
    for way, other in copies.items():
        assert is_patched(other), way
        attention_calls.clear()
        _assert_same_results(_t5_results(other, input_ids, attention_mask), want, f"T5/{way}")
        assert attention_calls, f"{way}: the copy does not run relbias attention"
    # each copy reads its own bias table: changing a copy's table changes its encoder output, not the original's
    for way, other in copies.items():
        with torch.no_grad():
            other.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(-1.0)
        changed = _t5_results(other, input_ids, attention_mask)["encoder"][0]
        assert not torch.equal(changed, want["encoder"][0]), way
    _assert_same_results(_t5_results(model, input_ids, attention_mask), want, "the original")


@pytest.mark.parametrize("way", ["pickle", "torch.save"])
def test_patched_t5_loaded_where_relbias_never_patched_a_model_generates_the_same(way, monkeypatch):
    """A process that loads a patched model but never called patch_t5 itself: relbias' attention function is not
    registered with transformers there (simulated by removing its registration)."""
    model = _t5_model(0)  # skips without a supported transformers
    from transformers.modeling_utils import AttentionInterface

    from relbias.integrations.transformers import ATTN_IMPLEMENTATION, patch_t5

    patch_t5(model)
    input_ids, attention_mask = _t5_batch()
    want = _t5_results(model, input_ids, attention_mask)
    buffer = io.BytesIO()
    if way == "torch.save":
        torch.save(model, buffer)
    else:
        pickle.dump(model, buffer)
    monkeypatch.delitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False) if way == "torch.save" else pickle.load(buffer)
    _assert_same_results(_t5_results(loaded, input_ids, attention_mask), want, f"T5/{way} in a new process")
