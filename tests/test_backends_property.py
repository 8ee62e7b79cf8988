"""Property (hypothesis): every registered backend computes what the reference backend computes, or refuses clearly.

For a random call (batch 1-2, 1-3 heads, head_dim 4/8/16, 1-40 queries and keys, square, decoding-like or at
explicit positions, float32 or float64, causal or not, each score convention and scale, every bias family of
``relbias.biases.FAMILIES`` plus a few variants, no bias or a bias tensor, no mask, a bool key padding mask, a full
bool mask or an additive float mask with -inf, with or without the log-sum-exp, with or without gradients), each
backend of ``relbias.backends.BACKENDS`` either

* runs, and agrees with the reference backend: the output and the log-sum-exp, and with gradients dq, dk, dv and the
  gradient of every bias parameter (or of the bias tensor), within the rounding tolerance of ``tests/_tolerance.py``
  for the dtype and the reduction length; a query with no visible key gets output exactly 0 and lse -inf, and every
  result is finite elsewhere (relbias.attention's docstring); or
* refuses with ``ValueError("backend 'NAME' cannot run this call: REASON")`` and ``relbias.explain_backend`` gives the
  same reason (``call_or_refusal``).

``backend="auto"`` always runs, agrees with the reference, and runs the backend ``explain_backend`` names, which
does not refuse the call. A causal-only bias (``bidirectional=False``) without ``is_causal`` comes either with a mask
that hides every future key, or with future keys visible: then every backend, auto and the reference raise the
library's ValueError about visible future keys.

FlexAttention runs eagerly (the ``small_tiles`` fixture: the same score_mod / mask_mod, no compilation per shape, as
the other backend property tests run it), and the tiled backends use 8 x 8 tiles, so lengths up to 40 span several.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import relbias
from relbias.backends import BACKENDS

from ._tolerance import assert_rounding_close, max_abs
from .hardening._cases import FAMILY_CASES, build_bias, call_or_refusal

#: Reproducible in CI: the examples are a function of the test (derandomize), not of a seed or a database.
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: Families drawn: every registered one ("none" is no bias), the hardening variants (T5 with few buckets, a clipped
#: per-offset table: far-constant at these lengths), and a materialised bias tensor.
BIAS_CASES = FAMILY_CASES + ["tensor"]
FUTURE_ERROR = re.escape("the bias is causal (bidirectional=False) and has no value for future keys")


@st.composite
def calls(draw):
    """``(q, k, v, kwargs, info)``: a random call of relbias.attention (kwargs without ``backend``) and what the
    test needs to know about it (gradients or not, cotangents, which queries see no key, whether the library must
    refuse the call for visible future keys of a causal-only bias; the seed of the tensors, to reproduce a failure)."""
    b, h, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8, 16]))
    layout = draw(st.sampled_from(["square", "decode", "explicit"]))
    positions = {}
    if layout == "square":
        lq = lk = draw(st.integers(1, 40))
    elif layout == "decode":  # a decoding step or chunk: queries on the last keys (the default alignment)
        lk = draw(st.integers(1, 40))
        lq = draw(st.integers(1, min(16, lk)))
    else:
        lq, lk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        positions = dict(query_start=draw(st.integers(-20, 60)), key_start=draw(st.integers(-20, 60)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    is_causal = draw(st.booleans())
    family = draw(st.sampled_from(BIAS_CASES))
    # a causal-only bias goes with is_causal; without it, sometimes a causal-only bias anyway (see the docstring)
    causal_only = is_causal or (family not in ("none", "tensor") and draw(st.booleans()))
    hide_future = causal_only and not is_causal and draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "padding", "full", "float"]))
    padding_rows_nonempty = draw(st.booleans())
    full_shape = draw(st.sampled_from([(lq, lk), (b, h, lq, lk), (b, 1, lq, lk), (1, h, lq, lk)]))
    bias_heads = draw(st.sampled_from([1, h]))
    tensor_shape = draw(st.sampled_from([(lq, lk), (1, h, lq, lk), (b, h, lq, lk), (b, 1, 1, lk)]))
    grad, return_lse = draw(st.booleans()), draw(st.booleans())
    convention = draw(st.sampled_from([None, "seed", "additive", "t5"]))
    seed = draw(st.integers(0, 2**16))

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, h, lk, d, generator=g, dtype=dtype) for _ in range(2))
    key_start = positions.get("key_start", 0)
    query_start = positions.get("query_start", key_start + lk - lq)
    offsets = (query_start + torch.arange(lq))[:, None] - (key_start + torch.arange(lk))[None, :]  # i - j, (Lq, Lk)

    mask = None
    if mask_kind == "padding":  # (B, 1, 1, Lk), True = may attend
        mask = torch.rand(b, 1, 1, lk, generator=g) < 0.6
        if padding_rows_nonempty:
            mask[torch.arange(b), 0, 0, torch.randint(0, lk, (b,), generator=g)] = True
    elif mask_kind == "full":
        mask = torch.rand(full_shape, generator=g) < 0.7
    elif mask_kind == "float":  # additive: finite values and -inf
        mask = torch.randn(b, 1, lq, lk, generator=g, dtype=dtype)
        mask[torch.rand(b, 1, lq, lk, generator=g) < 0.3] = float("-inf")
    if hide_future:  # the mask hides every future key of the causal-only bias
        past = offsets >= 0
        if mask is None:
            mask = past
        elif mask.dtype == torch.bool:
            mask = mask & past
        else:
            mask = torch.where(past, mask, float("-inf"))

    torch.manual_seed(seed)
    if family == "tensor":
        bias = (2.0 * torch.randn(tensor_shape, generator=g, dtype=dtype)).requires_grad_(grad)
    else:
        bias = build_bias(family, num_heads=bias_heads, bidirectional=not causal_only)
        if bias is not None:  # parameters in the inputs' dtype: a float32 bias is float32-rounded, each backend its
            bias = bias.to(dtype)  # own way (decode's offset table evaluates KERPLE 1 ulp apart from the reference)
    resolved = convention or (bias.default_convention if isinstance(bias, relbias.RelativeBias) else "seed")
    scale = draw(st.sampled_from([None, 1.0] if resolved == "t5" else [None, 0.5, 1.0, 2.0]))

    visible = torch.ones(1, 1, lq, lk, dtype=torch.bool)  # independent of relbias: which key each query sees
    if is_causal:
        visible = visible & (offsets >= 0)
    if mask is not None:
        visible = visible & (mask if mask.dtype == torch.bool else mask != float("-inf"))
    no_key = ~visible.expand(b, h, lq, lk).any(dim=-1)  # (B, H, Lq): queries with no visible key
    future_visible = causal_only and not is_causal and bool((visible & (offsets < 0)).any())

    kwargs = dict(bias=bias, mask=mask, is_causal=is_causal, scale=scale, convention=convention,
                  return_lse=return_lse, **positions)
    info = dict(seed=seed, grad=grad, no_key=no_key, future_error=future_visible,
                grad_out=torch.randn(b, h, lq, d, generator=g, dtype=dtype),
                grad_lse=torch.randn(b, h, lq, generator=g, dtype=dtype))
    event(f"layout {layout}, mask {mask_kind}, {'grad' if grad else 'no grad'}")
    return q, k, v, kwargs, info


def _bias_tensors(bias) -> list[torch.Tensor]:
    """What a gradient of the bias means: a module's parameters, or the bias tensor when it requires grad."""
    if isinstance(bias, relbias.RelativeBias):
        return list(bias.parameters())
    return [bias] if isinstance(bias, torch.Tensor) and bias.requires_grad else []


def _run(backend: str, q, k, v, kwargs, info):
    """``(out, lse, grads)`` of ``backend`` (lse None without return_lse; grads [dq, dk, dv, *bias grads], zeros for
    an unused one, or None without gradients), or the refusal's reason (a str) of a named backend."""
    grad = info["grad"]
    with torch.set_grad_enabled(grad):
        inputs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        if backend == "auto":  # auto never refuses
            result = relbias.attention(*inputs, backend="auto", **kwargs)
        else:
            result = call_or_refusal(backend, *inputs, **kwargs)
        if isinstance(result, str):
            return result
        out, lse = result if kwargs["return_lse"] else (result, None)
        grads = None
        if grad:
            loss = (out * info["grad_out"]).sum()
            if lse is not None:  # -inf rows (no visible key) enter with a zero cotangent
                loss = loss + (lse.masked_fill(~torch.isfinite(lse), 0.0) * info["grad_lse"].to(lse.dtype)).sum()
            wrt = inputs + _bias_tensors(kwargs["bias"])
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
    return out.detach(), None if lse is None else lse.detach(), grads


def _check_documented(name: str, out, lse, grads, no_key) -> None:
    """relbias.attention's documented results: out exactly 0 and lse -inf for a query with no visible key, finite
    values elsewhere, lse in float32 (float64 for float64 inputs), finite gradients."""
    assert not out[no_key].any(), f"{name}: a query with no visible key has a non-zero output"
    assert torch.isfinite(out).all(), f"{name}: non-finite output"
    if lse is not None:
        assert lse.dtype == (torch.float64 if out.dtype == torch.float64 else torch.float32), f"{name}: lse {lse.dtype}"
    if lse is not None:
        assert (lse[no_key] == float("-inf")).all(), f"{name}: lse of a query with no visible key is not -inf"
        assert torch.isfinite(lse[~no_key]).all(), f"{name}: non-finite lse of a query that sees a key"
    for i, g in enumerate(grads or []):
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient #{i}"


def _gradient_scales(q, k, v, kwargs, info, ref_out, ref_grads) -> list[float]:
    """Bounds on the magnitude of what each gradient sums (the ``scale`` of ``rounding_tolerance``), never below
    max |reference gradient|: a gradient that cancels to (near) zero still carries the rounding of its terms (with
    one key, dq is exactly 0 in exact arithmetic, a sum of P (dP - D) = 0 that each backend rounds its own way).

    With P the attention probabilities, c the multiplier of q . k, dP_ij = dO_i . v_j, D_i = dO_i . out_i and g_i the
    lse cotangent, the score gradient dS_ij = P_ij (dP_ij - D_i + g_i) is bounded by P_ij R, R = max|dP| + max|D| +
    max|g|; so |terms of dq_i| sum to <= c R max|k|, of dk_j to <= c R max|q| max_j sum_i P_ij, of dv_j to <= max|dO|
    max_j sum_i P_ij, and those of a bias parameter to J^T (c' R P), J the Jacobian of the bias and c' the
    convention's factor of the bias (exact for a Jacobian of one sign: tables, ALiBi, KERPLE)."""
    d = q.shape[-1]
    convention = kwargs["convention"] or (kwargs["bias"].default_convention
                                          if isinstance(kwargs["bias"], relbias.RelativeBias) else "seed")
    c = 1.0 if convention == "t5" else kwargs["scale"] or d ** -0.5
    grad_out = info["grad_out"]
    with torch.no_grad():
        weights = {n: a for n, a in kwargs.items() if n != "return_lse"}
        _, p = relbias.attention_with_weights(q, k, v, **weights)  # (B, H, Lq, Lk), 0 where hidden
        r = max_abs(grad_out @ v.transpose(-2, -1)) + max_abs((grad_out * ref_out).sum(-1))
        r += max_abs(info["grad_lse"]) if kwargs["return_lse"] else 0.0
        columns = max_abs(p.sum(dim=-2))
    bounds = [c * r * max_abs(k), c * r * max_abs(q) * columns, max_abs(grad_out) * columns]
    wrt = _bias_tensors(kwargs["bias"])
    if wrt:
        bias, a = kwargs["bias"], dict(query_start=kwargs.get("query_start"), key_start=kwargs.get("key_start", 0))
        with torch.enable_grad():
            pe = bias(q.shape[2], k.shape[2], **a) if isinstance(bias, relbias.RelativeBias) else bias
            cotangent = (1.0 if convention != "seed" else c) * r * p
            terms = torch.autograd.grad((pe.expand_as(p) * cotangent.to(pe.dtype)).sum(), wrt, allow_unused=True)
        bounds += [0.0 if t is None else max_abs(t) for t in terms]
    return [max(bound, max_abs(w)) for bound, w in zip(bounds, ref_grads)]


def _assert_agree(name: str, got, want, q, k, scales) -> None:
    """``got`` (a backend's (out, lse, grads)) equals ``want`` (the reference's) within the rounding tolerance of
    their dtype; ``scales``: those of the gradients (_gradient_scales)."""
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = got, want
    b, h, lq, d = q.shape
    lk = k.shape[2]
    assert_rounding_close(out, ref_out, n=max(d, lk), msg=lambda m: f"{name}, out: {m}")
    assert (lse is None) == (ref_lse is None), f"{name}: lse returned by one side only"
    if lse is not None:
        assert_rounding_close(lse, ref_lse, n=max(d, lk), msg=lambda m: f"{name}, lse: {m}")
    if grads is not None:
        # dq sums over keys, dk and dv over queries, a bias parameter over every (batch, head, query, key) pair
        lengths = [max(d, lk), max(d, lq), lq] + [b * h * lq * lk] * (len(grads) - 3)
        labels = ["dq", "dk", "dv"] + [f"bias grad #{i}" for i in range(len(grads) - 3)]
        for label, n, scale, g, w in zip(labels, lengths, scales, grads, ref_grads):
            assert_rounding_close(g, w, n=n, scale=scale, msg=lambda m, label=label: f"{name}, {label}: {m}")


@settings(max_examples=300, **SETTINGS)
@given(case=calls())
def test_every_backend_agrees_with_the_reference_or_refuses(case, small_tiles):
    q, k, v, kwargs, info = case
    names = list(BACKENDS) + ["auto"]
    if info["future_error"]:  # the library refuses the call itself, whichever backend is asked
        for name in names:
            with pytest.raises(ValueError, match=FUTURE_ERROR):
                relbias.attention(q, k, v, backend=name, **kwargs)
        event("visible future keys of a causal-only bias: refused")
        return

    want = _run("reference", q, k, v, kwargs, info)
    assert not isinstance(want, str), want
    _check_documented("reference", *want, info["no_key"])
    scales = _gradient_scales(q, k, v, kwargs, info, want[0], want[2]) if info["grad"] else None
    refused = {}
    for name in names:
        if name == "reference":
            continue
        got = _run(name, q, k, v, kwargs, info)
        if isinstance(got, str):
            refused[name] = got
            event(f"{name} refused")
            continue
        event(f"{name} compared")
        _check_documented(name, *got, info["no_key"])
        _assert_agree(name, got, want, q, k, scales)

    with torch.set_grad_enabled(info["grad"]):
        inputs = [t.detach().requires_grad_(info["grad"]) for t in (q, k, v)]
        chosen, _ = relbias.explain_backend(*inputs, backend="auto", **kwargs)
    assert chosen in BACKENDS and chosen not in refused, (chosen, refused.get(chosen))


def test_flex_float64_results_are_float64(small_tiles):
    """Float64 inputs with a bias and a float mask: flex keeps both, and its lse, in float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(1, 1, 12, 12, generator=g, dtype=torch.float64)
    bias = build_bias("kerple_power", num_heads=2, bidirectional=True).double()
    kwargs = dict(bias=bias, mask=mask, return_lse=True)
    with torch.no_grad():  # flex has no backward on CPU
        out, lse = relbias.attention(q, k, v, backend="flex", **kwargs)
        ref_out, ref_lse = relbias.attention(q, k, v, backend="reference", **kwargs)
    assert lse.dtype == torch.float64
    assert_rounding_close(out, ref_out, n=12)
    assert_rounding_close(lse, ref_lse, n=12)
