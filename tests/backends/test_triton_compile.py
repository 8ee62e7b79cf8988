"""The triton backend under torch.compile(fullgraph=True), run by the Triton interpreter on CPU tensors: forward and
backward are custom ops that pass torch.library.opcheck (masks, dropout, windows, packed sequences), and a compiled
call (aot_eager and inductor) traces with no graph break and equals eager in its output and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch

import relbias

from ._triton_cases import require_interpreter

require_interpreter()

from relbias.backends.triton._function import triton_backward, triton_forward  # noqa: E402

H, D = 2, 8


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _settings(lo=None, hi=None, delta=0, dropout_p=0.0, max_len=0):
    # scale, bias_scale, lo, hi, delta, query_pos, key_pos, dropout_p, batch_seed, max_len, block
    return (0.5, 1.0, lo, hi, delta, 3, 1, dropout_p, 12345, max_len, 16)


CASES = {  # name: (lq, lk, padded, varlen, settings)
    "plain": (5, 7, False, False, _settings(delta=2)),
    "causal window": (20, 20, False, False, _settings(lo=0, hi=None)),
    "band": (20, 24, False, False, _settings(lo=-3, hi=6, delta=-4)),
    "padding": (5, 7, True, False, _settings(delta=2)),
    "dropout": (18, 18, False, False, _settings(dropout_p=0.3)),
    "padding dropout band": (18, 18, True, False, _settings(lo=-2, hi=5, dropout_p=0.3)),
    "packed dropout": (19, 19, False, True, _settings(lo=0, dropout_p=0.3, max_len=11)),
}


@pytest.mark.parametrize("values_grad", [True, False], ids=["bias-grad", "no-bias-grad"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_custom_ops_pass_torch_library_opcheck(name, values_grad):
    """Schema, fake kernels against the real ones (shapes, strides, dtypes), and the autograd registration."""
    lq, lk, padded, varlen, settings = CASES[name]
    gen = torch.Generator().manual_seed(0)
    batch = 1 if varlen else 2
    q, k, v = (torch.randn(batch, H, n, D, generator=gen).requires_grad_() for n in (lq, lk, lk))
    width = (settings[9] if varlen else lk) + (settings[9] if varlen else lq) - 1
    values = torch.randn(width, H, generator=gen).t().requires_grad_(values_grad)  # strided, like a lookup
    padding = cu_seqlens = seeds = None
    if padded:  # uint8 (Bm, Hm, Lk), nonzero where kept: the last keys of head 0 hidden, every key of head 1
        padding = torch.ones(batch, H, lk, dtype=torch.uint8)
        padding[:, 0, lk - 3:] = 0
        padding[:, 1] = 0
    if varlen:
        cu_seqlens = torch.tensor([0, 6, 6, 17, 19], dtype=torch.int32)
        seeds = torch.tensor([5, 0, 7, 9], dtype=torch.int32)
    args = (q, k, v, values, padding, cu_seqlens, seeds, *settings)
    torch.library.opcheck(triton_forward, args)
    out, lse = triton_forward(*args)
    grads = (torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen))
    torch.library.opcheck(triton_backward, (*grads, q.detach(), k.detach(), v.detach(), values.detach(), padding,
                                            cu_seqlens, seeds, out.detach(), lse.detach(), *settings, True, True,
                                            values_grad))


def test_the_forward_op_reads_a_batch_seed_from_memory_as_it_takes_one_by_value():
    """A batch call's seed drawn in a compiled graph reaches the kernels as an int32 (1,) tensor (``seeds``, read by
    them): the ops pass opcheck with it, and drop exactly the entries the same seed passed by value drops."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 18, D, generator=gen).requires_grad_() for _ in range(3))
    values = torch.randn(35, H, generator=gen).t().requires_grad_()
    in_memory = (0.5, 1.0, None, None, 0, 3, 1, 0.3, 0, 0, 16)  # batch_seed 0: unused
    seed = torch.tensor([12345], dtype=torch.int32)
    args = (q, k, v, values, None, None, seed, *in_memory)
    torch.library.opcheck(triton_forward, args)
    out, lse = triton_forward(*args)
    by_value, _ = triton_forward(q, k, v, values, None, None, None, *_settings(dropout_p=0.3))
    torch.testing.assert_close(out, by_value, rtol=0, atol=0)
    grads = (torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen))
    torch.library.opcheck(triton_backward, (*grads, q.detach(), k.detach(), v.detach(), values.detach(), None, None,
                                            seed, out.detach(), lse.detach(), *in_memory, True, True, True))


def test_a_compiled_padded_call_with_dropout_equals_eager_without_graph_breaks():
    """The seed is drawn in the graph (the global generator's next number, as eager draws it) and read by the
    kernels: no graph break; aot_eager and inductor drawing eager's random numbers equal eager."""
    import torch._inductor.config as inductor_config

    bias = _t5(causal=True)
    q, k, v = (torch.randn(2, H, 20, D, generator=torch.Generator().manual_seed(n)) for n in range(3))
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., 14:] = False

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, mask=mask, is_causal=True, dropout_p=0.3, backend="triton")

    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch.manual_seed(4)
    want = _results(f, bias, q, k, v)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        torch.manual_seed(4)
        with inductor_config.patch(fallback_random=True):
            got = _results(torch.compile(f, fullgraph=True, backend=backend), bias, q, k, v)
        for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{backend} {name}: {m}")


def _results(fn, bias, *tensors):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    bias.zero_grad(set_to_none=True)
    out = fn(*tensors)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), *(t.grad for t in tensors), bias.weight.grad]


def _t5(causal):
    bias = relbias.T5Bias(H, bidirectional=not causal)
    with torch.no_grad():
        bias.weight.normal_(generator=torch.Generator().manual_seed(3))
    return bias


def _assert_compiled_equals_eager(f, bias, *tensors, backends=("aot_eager", "inductor")):
    explained = torch._dynamo.explain(f)(*tensors)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    want = _results(f, bias, *tensors)
    for backend in backends:
        torch._dynamo.reset()
        got = _results(torch.compile(f, fullgraph=True, backend=backend), bias, *tensors)
        for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{backend} {name}: {m}")


def test_a_compiled_call_equals_eager_without_graph_breaks():
    bias = _t5(causal=True)
    q, k, v = (torch.randn(2, H, n, D, generator=torch.Generator().manual_seed(n)) for n in (20, 24, 24))

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, is_causal=True, backend="triton")

    _assert_compiled_equals_eager(f, bias, q, k, v)


def test_a_compiled_padded_windowed_call_equals_eager_without_graph_breaks():
    bias = _t5(causal=False)
    q, k, v = (torch.randn(2, H, 20, D, generator=torch.Generator().manual_seed(n)) for n in range(3))
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., 14:] = False

    def f(q, k, v):
        return relbias.attention(q, k, v, bias=bias, mask=mask, window=(5, 3), backend="triton")

    _assert_compiled_equals_eager(f, bias, q, k, v, backends=("aot_eager",))


def test_compiled_packed_sequences_equal_eager_without_graph_breaks():
    bias = _t5(causal=True)
    q, k, v = (torch.randn(1, H, 19, D, generator=torch.Generator().manual_seed(n)) for n in range(3))

    def f(q, k, v):
        return relbias.attention_varlen(q, k, v, [0, 6, 6, 17, 19], bias=bias, is_causal=True, backend="triton")

    _assert_compiled_equals_eager(f, bias, q, k, v, backends=("aot_eager",))


@pytest.mark.parametrize("dropout_rate", [0.0, 0.1])
def test_a_compiled_patched_t5_trains_as_eager(dropout_rate, monkeypatch):
    """A tiny T5 patched with backend="triton", a batch with one sequence padded, three AdamW steps, compiled
    (aot_eager, fullgraph=True) and eager from the same weights and seed, without dropout and with T5's (its
    attention dropout inside relbias' kernels): no graph break, the same losses and parameters, and every attention
    call of both runs on triton, the encoder's with the (B, 1, 1, Lk) key padding mask transformers' 4D mask
    becomes (relbias::hf_masked_attention converts it where the compiled graph runs)."""
    transformers = pytest.importorskip("transformers")
    from relbias.backends.triton import TritonBackend
    from relbias.integrations.transformers import patch

    masks = []
    forward = TritonBackend.forward

    def spy(self, call):
        masks.append(None if call.mask is None else tuple(call.mask.shape))
        return forward(self, call)

    monkeypatch.setattr(TritonBackend, "forward", spy)
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=dropout_rate, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    start = transformers.T5ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(2, 32, (2, 18), generator=gen), torch.randint(2, 32, (2, 6), generator=gen)
    attention_mask = torch.ones(2, 18, dtype=torch.long)
    attention_mask[1, 12:], ids[1, 12:] = 0, 0
    batch = dict(input_ids=ids, attention_mask=attention_mask, labels=labels)
    runs = []
    for compiled in (False, True):
        model = patch(copy.deepcopy(start).train(), backend="triton")
        step = model.forward
        if compiled:
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(**batch)
            assert explained.graph_break_count == 0, explained.break_reasons
            step = torch.compile(model, fullgraph=True, backend="aot_eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(2)
        losses = []
        masks.clear()
        for _ in range(3):
            loss = step(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        assert sorted(masks, key=str) == sorted([(2, 1, 1, 18), None] * 3, key=str), (compiled, masks)
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(runs[0][0][0], runs[0][0][-1])  # the steps changed the model
