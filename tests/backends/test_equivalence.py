"""Every memory-efficient backend against the reference: outputs and all gradients, every bias family.

Covers causal and bidirectional attention, Lq != Lk with default and explicit positions, padding and
float masks, fp32 (tight tolerance) and bf16 (bound: twice the error of the reference run in bf16,
against the fp32 reference, plus a small atol — the rule of FlashAttention's tests), and the
determinism of the bias-table gradient.
"""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends import BACKENDS
from relbias.biases import FAMILIES, make_bias
from relbias.dispatch import explain_backend

from .._cpu import refused_here
from .._markers import triton_runs_on_cpu

#: Families to cover: every registered one, plus variants that make the structured backend split off
#: far parts at small lengths (T5 with few buckets, a clipped per-offset table).
FAMILY_CASES = sorted(FAMILIES) + ["t5_small", "offset_clip"]

#: (query_len, key_len, query_start, is_causal, mask kind): causal and bidirectional, Lq != Lk with
#: default (KV-cache) and explicit positions, bool padding masks and an additive float mask.
CONFIGS = [
    (29, 29, None, False, None),
    (29, 29, None, True, None),
    (11, 34, None, True, None),
    (21, 27, 3, False, None),
    (21, 27, 40, True, None),
    (29, 29, None, False, "padding"),
    (18, 25, None, True, "padding"),
    (23, 23, None, False, "float"),
]


def build_bias(name: str, *, num_heads: int, bidirectional: bool, max_len: int = 80):
    """A bias of family ``name`` with perturbed (non-default) parameters; None for "none"."""
    if name == "t5_small":
        bias = relbias.T5Bias(num_heads, num_buckets=8, max_distance=16, bidirectional=bidirectional)
    elif name == "offset_clip":
        bias = relbias.PerOffsetBias(max_len=6, num_heads=num_heads, bidirectional=bidirectional, out_of_range="clip")
    else:
        bias = make_bias(name, num_heads=num_heads, max_len=max_len, bidirectional=bidirectional)
    if bias is not None:
        with torch.no_grad():
            for p in bias.parameters():
                p.add_(0.5 * torch.randn_like(p))
    return bias


def make_mask(kind: str | None, batch: int, query_len: int, key_len: int) -> torch.Tensor | None:
    """None, a (B, 1, 1, Lk) bool key-padding mask (one batch row fully padded beyond key 3), or a
    (1, 1, Lq, Lk) float mask with finite values and some -inf."""
    if kind is None:
        return None
    if kind == "padding":
        mask = torch.ones(batch, 1, 1, key_len, dtype=torch.bool)
        mask[0, ..., key_len - 5 :] = False
        mask[-1, ..., 3:] = False
        return mask
    mask = 0.5 * torch.randn(1, 1, query_len, key_len)
    mask[torch.rand(1, 1, query_len, key_len) < 0.3] = float("-inf")
    return mask


def run(backend, query, key, value, bias, *, grad_out=None, **kwargs):
    """Output and gradients (query, key, value, then each bias parameter) of one call."""
    q, k, v = (t.detach().clone().requires_grad_(grad_out is not None) for t in (query, key, value))
    params = [p for p in bias.parameters()] if bias is not None else []
    for p in params:
        p.grad = None
    if grad_out is None:
        with torch.no_grad():
            return [relbias.attention(q, k, v, bias=bias, backend=backend, **kwargs)]
    out = relbias.attention(q, k, v, bias=bias, backend=backend, **kwargs)
    (out.float() * grad_out).sum().backward()
    grads = [q.grad, k.grad, v.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return [out.detach()] + grads


FAST_BACKENDS = [name for name in BACKENDS  # from the registry (triton where it takes CPU tensors)
                 if name != "reference" and (name != "triton" or triton_runs_on_cpu())]
B, H, D = 2, 3, 16


def _inputs(lq, lk, dtype=torch.float32):
    q, k, v = torch.randn(B, H, lq, D), torch.randn(B, H, lk, D), torch.randn(B, H, lk, D)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _can_run(backend, q, k, v, bias, mask, kwargs):
    try:
        explain_backend(q, k, v, bias=bias, mask=mask, backend=backend, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}x{c[1]}-qs{c[2]}-{'causal' if c[3] else 'bidi'}-{c[4]}")
@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fp32_output_and_gradients_match_reference(backend, family, config, small_tiles):
    lq, lk, query_start, is_causal, mask_kind = config
    bias = build_bias(family, num_heads=H, bidirectional=not is_causal)
    q, k, v = _inputs(lq, lk)
    mask = make_mask(mask_kind, B, lq, lk)
    kwargs = dict(is_causal=is_causal, query_start=query_start)
    why = _can_run(backend, q, k, v, bias, mask, kwargs)
    if backend == "blockwise":
        assert why is None, why  # the blockwise backend runs every family, alignment and mask
    if backend in ("flex", "decode"):  # forward only: no FlexAttention backward on CPU; decode is inference-only
        with torch.no_grad():
            why = _can_run(backend, q, k, v, bias, mask, kwargs)
        if why is not None:
            refused_here(backend, why, q)  # this CPU's refusal asserted by name, or skipped as a refusal of the call
            return
        got, want = run(backend, q, k, v, bias, mask=mask, **kwargs), run("reference", q, k, v, bias, mask=mask, **kwargs)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=2e-5)
        return
    if why is not None:
        if backend == "structured":
            assert mask is not None or family not in ("t5", "t5_small", "offset_clip")
        else:  # toeplitz and triton run every offset-only family without a mask
            assert backend in ("toeplitz", "triton") and (mask is not None or bias is None or not bias.offset_only), why
        pytest.skip(why)
    grad_out = torch.randn(B, H, lq, D)
    got = run(backend, q, k, v, bias, grad_out=grad_out, mask=mask, **kwargs)
    want = run("reference", q, k, v, bias, grad_out=grad_out, mask=mask, **kwargs)
    names = ["out", "dq", "dk", "dv"] + ([n for n, _ in bias.named_parameters()] if bias is not None else [])
    for name, g, w in zip(names, got, want):
        tol = 1e-4 * max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g, w, rtol=1e-4, atol=tol, msg=lambda m: f"{name}: {m}")


def _errors(results, reference):
    return [float((r.float() - w.float()).abs().max()) for r, w in zip(results, reference)]


@pytest.mark.parametrize("is_causal", [False, True], ids=["bidi", "causal"])
@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("backend", ["blockwise", "structured"])
def test_bf16_error_at_most_twice_the_reference_bf16_error(backend, family, is_causal, small_tiles):
    lq = lk = 40
    bias = build_bias(family, num_heads=H, bidirectional=not is_causal)
    q, k, v = _inputs(lq, lk)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    why = _can_run(backend, qb, kb, vb, bias, None, dict(is_causal=is_causal))
    if why is not None:
        refused_here(backend, why, qb)
        return
    grad_out = torch.randn(B, H, lq, D)
    exact = run("reference", q, k, v, bias, grad_out=grad_out, is_causal=is_causal)
    plain = run("reference", qb, kb, vb, bias, grad_out=grad_out, is_causal=is_causal)
    got = run(backend, qb, kb, vb, bias, grad_out=grad_out, is_causal=is_causal)
    names = ["out", "dq", "dk", "dv"] + ([n for n, _ in bias.named_parameters()] if bias is not None else [])
    for name, e_got, e_plain, w in zip(names, _errors(got, exact), _errors(plain, exact), exact):
        atol = 1e-3 * max(1.0, float(w.abs().max()))
        assert e_got <= 2 * e_plain + atol, f"{name}: error {e_got:.3g} > 2 x {e_plain:.3g} + {atol:.1g}"


@pytest.mark.parametrize("backend", ["blockwise", "structured", "toeplitz"])
@pytest.mark.parametrize("family", ["t5", "offset_clip"])
def test_bias_table_gradient_is_bit_identical_across_runs(backend, family, small_tiles):
    bias = build_bias(family, num_heads=H, bidirectional=True)
    q, k, v = _inputs(37, 37)
    grad_out = torch.randn(B, H, 37, D)
    first = run(backend, q, k, v, bias, grad_out=grad_out)[-1]
    for _ in range(2):
        assert torch.equal(run(backend, q, k, v, bias, grad_out=grad_out)[-1], first)


@pytest.mark.parametrize("is_causal", [False, True], ids=["bidi", "causal"])
@pytest.mark.parametrize("query_start", [None, 150, 260])
def test_structured_with_t5_default_buckets_splits_far_parts_exactly(is_causal, query_start):
    # 32 buckets / max_distance 128: constant beyond 91 (bidirectional) / 113 (causal) tokens, so a
    # 240 x 300 block has far parts in each direction; default tile sizes.
    bias = build_bias("t5", num_heads=H, bidirectional=not is_causal)
    lq, lk = 240, 300
    q, k, v = _inputs(lq, lk)
    kwargs = dict(is_causal=is_causal, query_start=query_start)
    if query_start == 260 and not is_causal:
        kwargs["query_start"] = 30
    assert explain_backend(q, k, v, bias=bias, backend="structured", **kwargs)[0] == "structured"
    grad_out = torch.randn(B, H, lq, D)
    got = run("structured", q, k, v, bias, grad_out=grad_out, **kwargs)
    want = run("reference", q, k, v, bias, grad_out=grad_out, **kwargs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * max(1.0, float(w.abs().max())))


@pytest.mark.parametrize("backend", ["blockwise", "structured", "toeplitz"])
def test_rows_without_a_visible_key_give_zeros_and_zero_gradients(backend, small_tiles):
    # queries at positions 0..9 against keys at 20..39, causal: every key is in the future.
    bias = build_bias("offset_clip" if backend == "structured" else "t5", num_heads=H, bidirectional=True)
    q, k, v = _inputs(10, 20)
    grad_out = torch.randn(B, H, 10, D)
    out, dq, dk, dv, *dbias = run(backend, q, k, v, bias, grad_out=grad_out, is_causal=True, query_start=0, key_start=20)
    assert torch.equal(out, torch.zeros_like(out))
    for g in (dq, dk, dv, *dbias):
        assert torch.equal(g, torch.zeros_like(g))


def test_seed_additive_and_t5_conventions_agree_with_reference(small_tiles):
    bias = build_bias("offset_clip", num_heads=1, bidirectional=True)
    q, k, v = _inputs(30, 30)
    for convention, scale in (("seed", None), ("seed", 0.7), ("additive", None), ("t5", None)):
        for backend in ("blockwise", "structured", "toeplitz"):
            got = run(backend, q, k, v, bias, convention=convention, scale=scale)[0]
            want = run("reference", q, k, v, bias, convention=convention, scale=scale)[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def test_auto_matches_reference_on_a_block_large_enough_to_tile(monkeypatch):
    bias = build_bias("t5", num_heads=2, bidirectional=True)
    q, k, v = (torch.randn(1, 2, 1100, 16) for _ in range(3))
    padding = torch.ones(1, 1, 1, 1100, dtype=torch.bool)
    padding[..., 1000:] = False  # a key padding mask: toeplitz takes it at every size (no small-block rule)
    assert explain_backend(q, k, v, bias=bias, mask=padding)[0] == "toeplitz"
    # 1 x 2 x 1100 x 1100 = 2.4M scores; a threshold above it would send auto to the reference instead of structured
    monkeypatch.setattr("relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES", 1000)
    with torch.no_grad():
        want = relbias.attention(q, k, v, bias=bias, mask=padding, backend="reference")
        for backend in ("auto", "structured"):
            got = relbias.attention(q, k, v, bias=bias, mask=padding, backend=backend)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def test_auto_takes_toeplitz_for_an_unmasked_offset_only_bias_at_any_size():
    """toeplitz has no small-block rule (one kernel call per block beat the reference from 64 tokens up)."""
    bias = build_bias("kerple_log", num_heads=2, bidirectional=True)
    for n in (8, 64, 1100):
        q = torch.randn(1, 2, n, 16)
        assert explain_backend(q, q, q, bias=bias)[0] == "toeplitz"
        assert explain_backend(q, q, q, bias=bias, is_causal=True)[0] == "toeplitz"
