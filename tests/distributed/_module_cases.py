"""Cases of the multi-process tests of relbias.nn.MultiheadAttention and patch_t5 with a process group: each
compares every rank's output shard and the gradients (inputs, every parameter, the bias tables included) with the
single-process module on the unsharded inputs, or checks a refusal. Shared by test_modules_cp.py (names) and
_module_worker.py (running them)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import relbias
from relbias.distributed import shard
from relbias.nn import MultiheadAttention

B, E, H = 2, 32, 4


@dataclass(frozen=True)
class MhaCase:
    name: str
    cross: bool
    causal: bool
    bias: str  # "t5", "t5_causal", "alibi", "none"
    layout: str
    strategy: str
    padding: bool
    q_len: int = 32
    memory_len: int = 24
    batch_first: bool = True
    new_group: bool = False  # a group made by dist.new_group rather than the default group
    window: tuple[int | None, int | None] | None = None  # local attention (left, right)


MHA_CASES = [
    MhaCase("self-t5-bidir-contiguous-ring-pad", False, False, "t5", "contiguous", "ring", True),
    MhaCase("self-t5-causal-zigzag-ring", False, True, "t5_causal", "zigzag", "ring", False),
    MhaCase("self-alibi-causal-contiguous-ulysses-pad", False, True, "alibi", "contiguous", "ulysses", True),
    MhaCase("self-none-bidir-zigzag-ulysses", False, False, "none", "zigzag", "ulysses", False),
    MhaCase("cross-t5-zigzag-pad", True, False, "t5", "zigzag", "ring", True),
    MhaCase("cross-none-contiguous", True, False, "none", "contiguous", "ring", False),
    MhaCase("self-t5-causal-contiguous-ring-pad-seq_first-new_group", False, True, "t5_causal", "contiguous", "ring",
            True, batch_first=False, new_group=True),
    MhaCase("self-t5-causal-contiguous-ring-pad-window", False, True, "t5_causal", "contiguous", "ring", True,
            window=(11, 0)),
    MhaCase("self-t5-causal-contiguous-auto-pad-window", False, True, "t5_causal", "contiguous", "auto", True,
            window=(11, 0)),  # the halo
    MhaCase("self-t5-bidir-contiguous-halo-window", False, False, "t5", "contiguous", "halo", False, window=(21, 4)),
    MhaCase("self-t5-bidir-zigzag-ulysses-window", False, False, "t5", "zigzag", "ulysses", False, window=(5, 3)),
    MhaCase("cross-t5-contiguous-window", True, False, "t5", "contiguous", "ring", False, window=(6, 6)),
]


@dataclass(frozen=True)
class T5Case:
    name: str
    layout: str
    strategy: str
    kind: str = "ForConditionalGeneration"
    family: str = "t5"
    attn_implementation: str = "sdpa"


T5_CASES = [
    T5Case("t5-contiguous-ring", "contiguous", "ring"),
    T5Case("t5-zigzag-ring", "zigzag", "ring"),
    T5Case("t5-contiguous-ulysses", "contiguous", "ulysses"),
    T5Case("t5-encoder-zigzag-ring", "zigzag", "ring", kind="EncoderModel"),
    T5Case("t5-eager-zigzag-ring", "zigzag", "ring", attn_implementation="eager"),
    T5Case("umt5-contiguous-ring", "contiguous", "ring", family="umt5"),
    T5Case("t5-encoder-contiguous-ulysses", "contiguous", "ulysses", kind="EncoderModel"),
]

#: refusal name -> (exception type name, substring of the message)
REFUSALS = {
    "mha_need_weights": ("ValueError", "need_weights=False"),
    "mha_attn_mask": ("ValueError", "attn_mask is not supported"),
    "mha_cache": ("NotImplementedError", "KV caches"),
    "mha_float_key_padding": ("TypeError", "must be bool"),
    "mha_halo_zigzag": ("ValueError", "strategy 'halo' exchanges the keys next to each contiguous shard"),
    "mha_halo_no_window": ("ValueError", "strategy 'halo' needs a window bounded on both sides"),
    "t5_generate": ("NotImplementedError", "generate() is not supported"),
    "t5_cached_decoding": ("NotImplementedError", "incremental decoding"),
    "t5_labels_only": ("ValueError", "decoder_input_ids"),
    "t5_output_attentions": ("NotImplementedError", "output_attentions"),
}


def _load(name: str, relative_path: str):
    """A file of tests/ loaded under its own module name (no sys.path change, no clash with pytest's conftest
    modules): this module is imported both by pytest and, from a worker script, as a top-level module."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / relative_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def hf_helpers():
    """tests/integrations/conftest.py (tiny_config, tiny_model, batch)."""
    return _load("_relbias_tiny_t5_helpers", "integrations/conftest.py")


_tolerance = _load("_relbias_tests_tolerance", "_tolerance.py")

#: The longest sum the compared results go through: a projection's gradient sums over the batch's tokens (B x 32;
#: the feature and head dims, 32 to 64, are no longer).
N_SUM = B * 32


def _excess(got, want, scale=None) -> float:
    """How far ``got`` is beyond the rounding tolerance around ``want`` (0.0 within it): the sharded run sums in
    another order (per-rank partial sums, a ring's or an all-to-all's blocks) than the single process, so the
    results agree to rounding only (tests/_tolerance.py: float32 with N_SUM terms, scaled by max |want| or
    ``scale``), which is still far below the O(1) error of a missing or doubled reduction over the ranks."""
    if got is None or want is None:
        return float("inf") if (got is None) != (want is None) else 0.0
    atol, rtol = _tolerance.rounding_tolerance(want, n=N_SUM, scale=scale)
    return max(((got - want).abs() - (atol + rtol * want.abs())).max().item(), 0.0)


def _grad_errors(model, ref_model, summed) -> dict:
    """Every parameter's gradient against the reference's: those not already summed over the group (``summed``
    says which are) are all-reduced first, as data-parallel training would.

    Each gradient is compared at the scale of its module's gradients (a Linear's weight and bias together): a
    bias's gradient sums the same per-token output gradients whose products with the inputs make the weight's, and
    it can cancel to rounding noise (the key projection's bias gets exactly zero in exact arithmetic, softmax being
    invariant to one constant added to every score of a query), which its own scale would not bound."""
    module_scale: dict = {}
    for name, rp in ref_model.named_parameters():
        if rp.grad is not None:
            owner = name.rpartition(".")[0]
            module_scale[owner] = max(module_scale.get(owner, 0.0), _tolerance.max_abs(rp.grad))
    errors = {}
    for (name, p), (_, rp) in zip(model.named_parameters(), ref_model.named_parameters()):
        grad = p.grad
        if grad is not None and not summed(name):
            grad = grad.clone()
            dist.all_reduce(grad)
        errors["d:" + name] = _excess(grad, rp.grad, scale=module_scale.get(name.rpartition(".")[0]))
    return errors


def _make_bias(kind: str):
    if kind == "t5":
        return relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=0.5)
    if kind == "t5_causal":
        return relbias.T5Bias(H, num_buckets=8, max_distance=16, bidirectional=False, init_std=0.5)
    if kind == "alibi":
        return relbias.ALiBiBias(H, bidirectional=False)
    return None


def run_mha_case(case: MhaCase, rank: int, world_size: int) -> dict:
    torch.manual_seed(7)
    kwargs = dict(batch_first=case.batch_first, position_bias=_make_bias(case.bias), is_causal=case.causal,
                  cross_attention=case.cross, window=case.window)
    ref_layer = MultiheadAttention(E, H, **kwargs)
    kwargs["position_bias"] = _make_bias(case.bias)  # its own bias module, loaded with the reference's state
    group = dist.new_group([0, 1]) if case.new_group else dist.group.WORLD
    layer = MultiheadAttention(E, H, **kwargs, process_group=group, cp_layout=case.layout,
                               cp_strategy=case.strategy)
    layer.load_state_dict(ref_layer.state_dict())
    x = torch.randn(B, case.q_len, E) * 0.5
    mem = torch.randn(B, case.memory_len, E) * 0.5 if case.cross else x
    g = torch.randn(B, case.q_len, E)
    key_len = case.memory_len if case.cross else case.q_len
    pad = torch.zeros(B, key_len, dtype=torch.bool)
    if case.padding:
        pad[1, :3] = True
        pad[1, key_len - 5 :] = True

    def local(t, dim=1):
        return shard(t, world_size, rank, layout=case.layout, dim=dim)

    if not case.batch_first:  # (L, B, E); the padding mask stays (B, L)
        x, mem, g = (t.transpose(0, 1).contiguous() for t in (x, mem, g))

        def local(t, dim=0):  # noqa: F811
            return shard(t, world_size, rank, layout=case.layout, dim=dim if t.dim() == 3 else 1)

    ref_x = x.clone().requires_grad_(True)
    ref_mem = mem.clone().requires_grad_(True) if case.cross else ref_x
    ref_out, _ = ref_layer(ref_x, ref_mem, ref_mem, key_padding_mask=pad if case.padding else None, need_weights=False)
    (ref_out * g).sum().backward()

    my_x = local(x).requires_grad_(True)
    my_mem = local(mem).requires_grad_(True) if case.cross else my_x
    out, weights = layer(my_x, my_mem, my_mem, key_padding_mask=local(pad) if case.padding else None,
                         need_weights=False)
    (out * local(g)).sum().backward()
    errors = {"out": _excess(out, local(ref_out)), "dx": _excess(my_x.grad, local(ref_x.grad))}
    if case.cross:
        errors["dmemory"] = _excess(my_mem.grad, local(ref_mem.grad))
    # self-attention: context_parallel_attention sums the bias gradients over the group already
    errors.update(_grad_errors(layer, ref_layer, lambda name: name.startswith("position_bias.") and not case.cross))
    with torch.no_grad():
        out_ng, _ = layer(my_x, my_mem, my_mem, key_padding_mask=local(pad) if case.padding else None,
                          need_weights=False)
    errors["out_no_grad"] = _excess(out_ng, local(ref_out))
    errors["weights_none"] = 0.0 if weights is None else float("inf")
    return {"errors": errors}


#: Smallest |pre-activation| a ReLU feed-forward layer of the reference model may see on the T5 cases' inputs: the
#: gradient of ReLU jumps at 0, so a pre-activation within float32 rounding of 0 (~1e-6 here) makes the gradients
#: depend on which (correct) backend computed the forward. The encoder batch seed is chosen to keep clear of it.
RELU_MARGIN = 1e-5
T5_INPUT_SEED = 6  # seed 1 put one encoder ReLU input at 1.3e-7 (float64: 2.1e-7): gradients then differed by ~5%


def _relu_inputs_margin(model) -> list:
    """Forward hooks recording min |input| of each ReLU feed-forward layer (``DenseReluDense.wi``; gated-GELU
    families have no ``wi`` and no kink); returns the list they append to."""
    margins: list = []
    if getattr(model.config, "dense_act_fn", "relu") != "relu":
        return margins
    for name, module in model.named_modules():
        if name.endswith("DenseReluDense.wi"):
            module.register_forward_hook(lambda mod, inp, out: margins.append(out.detach().abs().min().item()))
    return margins


def run_t5_case(case: T5Case, rank: int, world_size: int) -> dict:
    from relbias.integrations.transformers import patch_t5

    hf = hf_helpers()
    settings = dict(attn_implementation=case.attn_implementation)
    ref = hf.tiny_model(case.family, case.kind, **settings)  # seeded: the same weights in every process
    model = patch_t5(hf.tiny_model(case.family, case.kind, **settings), process_group=dist.group.WORLD,
                     layout=case.layout, strategy=case.strategy)
    margins = _relu_inputs_margin(ref)
    input_ids, attention_mask = hf.batch(batch_size=B, length=32, pad_last=7, seed=T5_INPUT_SEED)
    dec_ids, dec_mask = hf.batch(batch_size=B, length=16, pad_last=3, seed=2)
    labels, _ = hf.batch(batch_size=B, length=16, seed=3)

    def local(t):
        return shard(t, world_size, rank, layout=case.layout, dim=1)

    def summed(name):
        return name.endswith("relative_attention_bias.weight")

    if case.kind == "EncoderModel":
        want = ref(input_ids, attention_mask=attention_mask).last_hidden_state
        got = model(local(input_ids), attention_mask=local(attention_mask)).last_hidden_state
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
        (want * g).sum().backward()
        (got * local(g)).sum().backward()
        errors = {"encoder": _excess(got, local(want)), "relu_margin": max(RELU_MARGIN - min(margins, default=1.0), 0.0)}
        errors.update(_grad_errors(model, ref, summed))
        return {"errors": errors}

    step = _load("_relbias_distributed_compare", "distributed/_compare.py").seq2seq_step
    want = step(ref, input_ids, attention_mask, dec_ids, dec_mask, labels)
    got = step(model, *(local(t) for t in (input_ids, attention_mask, dec_ids, dec_mask, labels)))
    errors = {
        "relu_margin": max(RELU_MARGIN - min(margins, default=1.0), 0.0),  # the inputs keep clear of ReLU's kink
        "encoder": _excess(got.encoder_last_hidden_state, local(want.encoder_last_hidden_state)),
        "logits": _excess(got.logits, local(want.logits)),
    }
    errors.update(_grad_errors(model, ref, summed))
    with torch.no_grad():  # inference, transformers' default use_cache=True (an empty cache: a full forward)
        again = model(input_ids=local(input_ids), attention_mask=local(attention_mask),
                      decoder_input_ids=local(dec_ids), decoder_attention_mask=local(dec_mask))
    errors["logits_no_grad_use_cache"] = _excess(again.logits, local(want.logits))
    return {"errors": errors}


def run_refusal(name: str, rank: int, world_size: int) -> str | None:
    """Make the refused call; return ``"TypeName: message"`` of what it raised, or None if it did not raise."""
    torch.manual_seed(0)
    try:
        if name.startswith("mha_halo_"):
            zigzag = name.endswith("zigzag")
            MultiheadAttention(E, H, batch_first=True, process_group=dist.group.WORLD, cp_strategy="halo",
                               window=(3, 3) if zigzag else None, cp_layout="zigzag" if zigzag else "contiguous")
        elif name.startswith("mha_"):
            layer = MultiheadAttention(E, H, batch_first=True, process_group=dist.group.WORLD)
            x = torch.randn(1, 8, E)
            if name == "mha_need_weights":
                layer(x, x, x)
            elif name == "mha_attn_mask":
                layer(x, x, x, need_weights=False, attn_mask=torch.zeros(8, 8, dtype=torch.bool))
            elif name == "mha_cache":
                layer(x, x, x, need_weights=False, cache=relbias.nn.KVCache())
            elif name == "mha_float_key_padding":
                layer(x, x, x, need_weights=False, key_padding_mask=torch.zeros(1, 8))
        else:
            from relbias.integrations.transformers import patch_t5

            hf = hf_helpers()
            model = patch_t5(hf.tiny_model("t5"), process_group=dist.group.WORLD)
            ids, mask = hf.batch(batch_size=1, length=8)
            with torch.no_grad():
                if name == "t5_generate":
                    model.generate(ids, attention_mask=mask, max_new_tokens=2)
                elif name == "t5_cached_decoding":
                    out = model(ids, attention_mask=mask, decoder_input_ids=ids[:, :4], use_cache=True)
                    model(encoder_outputs=(out.encoder_last_hidden_state,), attention_mask=mask,
                          decoder_input_ids=ids[:, :1], cache=out.cache, use_cache=True)
                elif name == "t5_labels_only":
                    model(ids, attention_mask=mask, labels=ids)
                elif name == "t5_output_attentions":
                    model(ids, attention_mask=mask, decoder_input_ids=ids, output_attentions=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks type and message
        return f"{type(exc).__name__}: {exc}"
    return None
