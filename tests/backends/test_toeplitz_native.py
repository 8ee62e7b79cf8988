"""The toeplitz native kernels (csrc/): the backward against its Python version and the reference, float64 to 1e-9
on uneven shapes (tiles smaller than and not dividing the lengths, causal and bidirectional, Lq != Lk, queries that
see no key, a bias shared by every head, an lse gradient), float32 against float64, bit-identical repeats, and the
fallback to Python (RELBIAS_NATIVE=0 silently, a failed build with one warning per kernel); the forward likewise
against the CPU flash kernel path and, for every offset-only family, the reference (Lq = 1 too), bit-identical
repeats on 1 and 2 threads, non-contiguous inputs, a NaN query."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import relbias
from relbias.backends import toeplitz
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias.backends.toeplitz._backward import tiled_backward
from relbias.backends.toeplitz._kernel import _forward_impl
from relbias.backends.toeplitz._view import future_offsets, reversed_bias
from relbias.biases import make_bias

from .._tolerance import assert_rounding_close
from ._toeplitz_cases import family_bias, run_with_grads

B, H, D = 2, 3, 8

pytestmark = pytest.mark.skipif(
    _toeplitz_native.native_unavailable_reason() is not None,
    reason=f"native toeplitz backward unavailable: {_toeplitz_native.native_unavailable_reason()}",
)


def _inputs(lq, lk, hb, delta, is_causal, dtype, *, grad_lse=True, seed=0, tile=5):
    """Random q, k, v, the toeplitz forward's out and lse, dO, an lse gradient and the reversed bias ``w``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (lq, lk, lk))
    values = torch.randn(hb, lq + lk - 1, generator=g, dtype=dtype)
    scale = D ** -0.5
    out, lse = _forward_impl(q, k, v, values, None, scale, 1.0, delta, is_causal, 7, tile, 0.0, 0, 0, 0, -1, -1)
    do = torch.randn(out.shape, generator=g, dtype=dtype)
    glse = torch.randn(lse.shape, generator=g, dtype=lse.dtype).masked_fill(lse == float("-inf"), 0.0)
    w = reversed_bias(values, dtype, 1.0, is_causal, delta, lk)
    plan = {"scale": scale, "delta": delta, "is_causal": is_causal, "tile": tile}
    return (do, q, k, v, out, lse, glse if grad_lse else None, w), plan


def _visible(grad_w, delta, lk, is_causal):
    """grad_w with its future offsets (no query sees them; unspecified values) zeroed."""
    if not is_causal:
        return grad_w
    return grad_w.flip(-1).masked_fill(future_offsets(grad_w, delta, lk), 0.0).flip(-1)


DIRECT = [  # (Lq, Lk, Hb, delta, is_causal, tile)
    (45, 45, H, 0, True, 7),
    (45, 45, H, 0, False, 16),
    (17, 50, H, 33, True, 5),  # a KV cache: queries on the last keys
    (50, 17, 1, 0, True, 6),  # more queries than keys, one bias for every head
    (30, 40, H, -12, True, 9),  # the first 12 queries see no key
    (30, 40, 1, 22, False, 64),  # one tile larger than both lengths
]


@pytest.mark.parametrize("blas", [True, False], ids=["blas", "addmm"])
@pytest.mark.parametrize(
    "case", DIRECT, ids=lambda c: f"{c[0]}x{c[1]}-hb{c[2]}-d{c[3]}-{'causal' if c[4] else 'bidi'}-t{c[5]}"
)
def test_float64_native_equals_the_python_tiled_backward(case, blas):
    lq, lk, hb, delta, is_causal, tile = case
    args, plan = _inputs(lq, lk, hb, delta, is_causal, torch.float64, tile=tile)
    got = _toeplitz_native.native_backward(*args, plan, blas=blas)
    want = tiled_backward(*args, plan)
    for name, g, w in zip(["dq", "dk", "dv", "grad_w"], got, want):
        if name == "grad_w":
            g, w = _visible(g, delta, lk, is_causal), _visible(w, delta, lk, is_causal)
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    if delta < 0 and is_causal:  # queries that see no key get exactly zero
        assert bool((got[0][:, :, :-delta] == 0).all())


def _python_must_not_run(*args, **kwargs):
    raise AssertionError("the Python tiled_backward ran: the native kernel was expected")


CASES = [  # (Lq, Lk, query_start, key_start, is_causal, family, bias heads)
    (45, 45, None, 0, True, "kerple_log", H),
    (45, 45, None, 0, False, "kerple_log", H),
    (17, 50, None, 0, True, "t5", H),
    (50, 17, 0, 0, True, "kerple_power", H),
    (30, 40, -12, 0, True, "kerple_log", H),  # the first 12 queries see no key
    (30, 40, 25, 3, False, "function", 1),  # one bias for every head
    (33, 33, None, 0, True, "function", 1),
]


@pytest.mark.parametrize("tile", [5, 16])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-qs{c[2]}-{'causal' if c[4] else 'bidi'}-{c[5]}-hb{c[6]}"
)
def test_float64_attention_through_the_native_kernel_matches_the_reference(case, tile, monkeypatch):
    monkeypatch.setattr(toeplitz, "TILE", tile)
    monkeypatch.setattr(toeplitz, "BLOCK_Q", 11)
    monkeypatch.setattr(_toeplitz_native, "tiled_backward", _python_must_not_run)
    lq, lk, query_start, key_start, is_causal, family, heads = case
    torch.manual_seed(lq + lk + tile)
    bias, params = family_bias(family, bidirectional=not is_causal or family == "function", num_heads=heads)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (lq, lk, lk))
    kwargs = dict(is_causal=is_causal, query_start=query_start, key_start=key_start)
    got = run_with_grads("toeplitz", q, k, v, bias, params, **kwargs)
    want = run_with_grads("reference", q, k, v, bias, params, **kwargs)
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv", "bias"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("is_causal", [True, False])
def test_float32_native_is_close_to_the_float64_reference(is_causal, monkeypatch):
    monkeypatch.setattr(toeplitz, "TILE", 24)
    monkeypatch.setattr(_toeplitz_native, "tiled_backward", _python_must_not_run)
    torch.manual_seed(3)
    bias, params = family_bias("kerple_log", bidirectional=not is_causal)
    q, k, v = (torch.randn(B, H, 70, D, dtype=torch.float64) for _ in range(3))
    bias32 = copy.deepcopy(bias).float()
    want = run_with_grads("reference", q, k, v, bias, params, is_causal=is_causal)
    got = run_with_grads("toeplitz", q.float(), k.float(), v.float(), bias32, list(bias32.parameters()), is_causal=is_causal)
    assert len(got) == len(want) > 5
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv", "bias", "bias"], got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("hb", [H, 1])
def test_float32_results_are_bit_identical_across_runs(hb):
    args, plan = _inputs(90, 90, hb, 0, True, torch.float32, tile=16)
    first = _toeplitz_native.native_backward(*args, plan)
    second = _toeplitz_native.native_backward(*args, plan)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _strided(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (equal values) in another memory layout: "transposed" as a (B, L, H, D) projection's transpose, "slice" a
    piece along L of a longer tensor, "padded" rows 3 entries longer than D; a (B, H, L) tensor: a slice along L."""
    if t.dim() == 3:
        return torch.cat([t, torch.zeros_like(t)], dim=2)[:, :, : t.shape[2]]
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "slice":
        return torch.cat([torch.zeros_like(t[:, :, :3]), t, torch.zeros_like(t)], dim=2)[:, :, 3 : 3 + t.shape[2]]
    return torch.cat([t, torch.zeros_like(t[..., :3])], dim=-1)[..., : t.shape[-1]]  # padded


LAYOUTS = ["transposed", "slice", "padded"]


@pytest.mark.parametrize("blas", [True, False], ids=["blas", "addmm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_inputs_are_read_in_place_and_give_contiguous_gradients(layout, blas):
    args, plan = _inputs(20, 20, H, 0, True, torch.float64, tile=8)
    strided = [t if t is None or t.dim() == 2 else _strided(t, layout) for t in args]
    assert not strided[1].is_contiguous() and not strided[5].is_contiguous()
    assert all(_toeplitz_native.rows_layout(t) is t for t in strided[:5])  # no copy
    got = _toeplitz_native.native_backward(*strided, plan, blas=blas)
    want = _toeplitz_native.native_backward(*args, plan, blas=blas)
    # Other strides are another code path: the GEMMs get other leading dimensions, and rows that start off a vector
    # boundary ("padded") take the -march=native loops' unaligned paths, so the sums round differently. The longest
    # sum: grad_w over the batch and a diagonal of 20 pairs.
    for name, g, w in zip(["dq", "dk", "dv", "grad_w"], got, want):
        assert g.is_contiguous() and g.shape == w.shape
        if name == "grad_w":  # future offsets: unspecified values
            g, w = _visible(g, 0, 20, True), _visible(w, 0, 20, True)
        assert_rounding_close(g, w, n=B * 20, msg=lambda m: f"{name}: {m}")


def test_rows_closer_than_head_dim_are_copied():
    row = torch.randn(B, H, 1, D, dtype=torch.float64)
    broadcast = row.expand(B, H, 9, D)  # stride 0 along L: one row read 9 times
    copied = _toeplitz_native.rows_layout(broadcast)
    assert copied is not broadcast and copied.is_contiguous() and torch.equal(copied, broadcast)
    w = torch.randn(H, 17, dtype=torch.float64)
    plan = {"scale": 0.3, "delta": 0, "is_causal": False, "tile_q": 4, "tile_k": 4}
    got = _toeplitz_native.native_forward(row.expand(B, H, 9, D), broadcast, broadcast, w, plan)
    want = _toeplitz_native.native_forward(*(broadcast.contiguous() for _ in range(3)), w, plan)
    # The same code path on both sides: rows_layout hands the kernel a fresh contiguous copy of each broadcast, as
    # the caller's .contiguous() does (same values, strides and the CPU allocator's 64-byte alignment).
    assert all(torch.equal(g, x) for g, x in zip(got, want))


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_toeplitz_native, "_warned", set())


def _attention_grads(monkeypatch):
    monkeypatch.setattr(toeplitz, "TILE", 8)
    torch.manual_seed(5)
    bias, params = family_bias("kerple_log", bidirectional=False)
    q, k, v = (torch.randn(B, H, 21, D, dtype=torch.float64) for _ in range(3))
    return run_with_grads("toeplitz", q, k, v, bias, params, is_causal=True)


def test_relbias_native_0_falls_back_to_python_silently(monkeypatch, fresh_warnings):
    native = _attention_grads(monkeypatch)
    monkeypatch.setenv("RELBIAS_NATIVE", "0")
    assert _toeplitz_native.load_native() is None
    calls = []
    python_backward = _toeplitz_native.tiled_backward
    monkeypatch.setattr(_toeplitz_native, "tiled_backward", lambda *a, **kw: calls.append(1) or python_backward(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit opt-out: nothing to warn about
        python = _attention_grads(monkeypatch)
    assert calls == [1]
    for g, w in zip(python, native):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_a_failed_build_falls_back_to_python_and_names_the_error(monkeypatch, fresh_warnings):
    def broken_build():
        raise OSError("no compiler here")

    args = _inputs(10, 10, H, 0, True, torch.float64)[0]  # by the native forward, before the build breaks
    monkeypatch.setattr(_toeplitz_native, "_loaded", {})
    monkeypatch.setattr(_toeplitz_native, "_build", broken_build)
    assert "no compiler here" in _toeplitz_native.native_unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable"):
        _toeplitz_native.native_backward(*args, {"scale": 1.0, "delta": 0, "is_causal": True, "tile": 4})
    with pytest.raises(RuntimeError, match="unavailable"):
        _toeplitz_native.native_forward(*args[1:4], args[7], {"scale": 1.0, "delta": 0, "is_causal": True,
                                                               "tile_q": 4, "tile_k": 4})
    with pytest.warns(RuntimeWarning, match="no compiler here") as caught:
        _attention_grads(monkeypatch)
    messages = [str(w.message) for w in caught]
    assert any("forward runs PyTorch's flash kernel" in m for m in messages)  # once each
    assert any("backward runs in Python" in m for m in messages)
    assert len(messages) == 2


# The native forward (csrc/toeplitz_forward.cpp).

FORWARD_DIRECT = [  # (Lq, Lk, Hb, delta, is_causal, tile_q, tile_k)
    (45, 45, H, 0, True, 7, 5),
    (45, 45, H, 0, False, 16, 9),
    (17, 50, H, 33, True, 5, 6),  # a KV cache: queries on the last keys
    (50, 17, 1, 0, True, 6, 4),  # more queries than keys, one bias for every head
    (30, 40, H, -12, True, 9, 7),  # the first 12 queries see no key
    (30, 40, H, -35, True, 4, 4),  # no query sees a key
    (30, 40, 1, 22, False, 64, 64),  # one tile larger than both lengths
    (1, 40, H, 39, True, 4, 8),  # one query (decoding)
    (1, 1, 1, 0, False, 3, 3),
]


def _forward_inputs(lq, lk, hb, delta, is_causal, dtype, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (lq, lk, lk))
    values = torch.randn(hb, lq + lk - 1, generator=g, dtype=dtype)
    return q, k, v, values


def _flash_forward(q, k, v, values, scale, delta, is_causal, monkeypatch):
    """The PyTorch path of _forward_impl (the CPU flash kernel per query block)."""
    with monkeypatch.context() as m:
        m.setenv("RELBIAS_NATIVE", "0")
        return _forward_impl(q, k, v, values, None, scale, 1.0, delta, is_causal, 7, 5, 0.0, 0, 0, 0, -1, -1)


@pytest.mark.parametrize("blas", [True, False], ids=["blas", "addmm"])
@pytest.mark.parametrize(
    "case", FORWARD_DIRECT,
    ids=lambda c: f"{c[0]}x{c[1]}-hb{c[2]}-d{c[3]}-{'causal' if c[4] else 'bidi'}-t{c[5]}x{c[6]}",
)
def test_float64_native_forward_equals_the_flash_path(case, blas, monkeypatch):
    lq, lk, hb, delta, is_causal, tile_q, tile_k = case
    q, k, v, values = _forward_inputs(lq, lk, hb, delta, is_causal, torch.float64)
    scale = D ** -0.5
    w = reversed_bias(values, torch.float64, 1.0, is_causal, delta, lk)
    plan = {"scale": scale, "delta": delta, "is_causal": is_causal, "tile_q": tile_q, "tile_k": tile_k}
    out, lse = _toeplitz_native.native_forward(q, k, v, w, plan, blas=blas)
    want_out, want_lse = _flash_forward(q, k, v, values, scale, delta, is_causal, monkeypatch)
    assert out.shape == want_out.shape and out.dtype == torch.float64 and out.is_contiguous()
    assert lse.shape == want_lse.shape and lse.dtype == want_lse.dtype and lse.is_contiguous()
    torch.testing.assert_close(out, want_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, want_lse, rtol=1e-9, atol=1e-9)
    blind = min(lq, max(0, -delta)) if is_causal else 0  # queries before every key
    assert bool((lse[:, :, :blind] == float("-inf")).all()) and bool((out[:, :, :blind] == 0).all())
    assert bool(torch.isfinite(lse[:, :, blind:]).all())


def _flash_must_not_run(*args, **kwargs):
    raise AssertionError("the CPU flash kernel ran: the native forward was expected")


FORWARD_CASES = [  # (Lq, Lk, query_start, key_start, is_causal, bias heads)
    (45, 45, None, 0, True, H),
    (45, 45, None, 0, False, H),
    (17, 50, None, 0, True, H),  # queries on the last keys
    (50, 17, 0, 0, True, H),  # more queries than keys, top-left
    (30, 40, -12, 0, True, H),  # the first 12 queries see no key
    (30, 40, 25, 3, False, 1),  # one bias for every head
    (1, 33, None, 0, True, H),  # one query
    (1, 33, None, 0, False, 1),
]


@pytest.mark.parametrize("tiles", [(5, 7), (16, 4), (64, 64)], ids=lambda t: f"t{t[0]}x{t[1]}")
@pytest.mark.parametrize(
    "case", FORWARD_CASES, ids=lambda c: f"{c[0]}x{c[1]}-qs{c[2]}-ks{c[3]}-{'causal' if c[4] else 'bidi'}-hb{c[5]}"
)
@pytest.mark.parametrize("family", ["alibi", "kerple_log", "kerple_power", "offset_clip", "t5", "function"])
def test_float64_native_forward_matches_the_reference(family, case, tiles, monkeypatch):
    from relbias.backends.toeplitz import _kernel as _toeplitz_kernel

    monkeypatch.setattr(toeplitz, "BLOCK_Q", 64)  # caps the tiles: above them
    monkeypatch.setattr(_toeplitz_native, "FORWARD_TILE_Q", tiles[0])
    monkeypatch.setattr(_toeplitz_native, "FORWARD_TILE_K", tiles[1])
    monkeypatch.setattr(_toeplitz_kernel, "fused_forward", _flash_must_not_run)
    lq, lk, query_start, key_start, is_causal, heads = case
    torch.manual_seed(lq + lk)
    if family == "offset_clip":
        bias = make_bias("offset", num_heads=heads, max_len=20, bidirectional=not is_causal,
                         out_of_range="clip").double()
        with torch.no_grad():
            for p in bias.parameters():
                p.add_(0.5 * torch.randn_like(p))
    else:
        bias, _ = family_bias(family, bidirectional=not is_causal or family == "function", num_heads=heads)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (lq, lk, lk))
    kwargs = dict(is_causal=is_causal, query_start=query_start, key_start=key_start, return_lse=True)
    assert relbias.explain_backend(q, k, v, bias=bias, backend="toeplitz", is_causal=is_causal,
                                   query_start=query_start, key_start=key_start)[0] == "toeplitz"
    with torch.no_grad():
        got = relbias.attention(q, k, v, bias=bias, backend="toeplitz", **kwargs)
        want = relbias.attention(q, k, v, bias=bias, backend="reference", **kwargs)
    for name, g, w in zip(["out", "lse"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("is_causal", [True, False])
def test_float32_native_forward_is_close_to_the_float64_reference(is_causal, monkeypatch):
    from relbias.backends.toeplitz import _kernel as _toeplitz_kernel

    monkeypatch.setattr(_toeplitz_native, "FORWARD_TILE_Q", 24)
    monkeypatch.setattr(_toeplitz_native, "FORWARD_TILE_K", 40)
    monkeypatch.setattr(_toeplitz_kernel, "fused_forward", _flash_must_not_run)
    torch.manual_seed(3)
    bias, _ = family_bias("kerple_log", bidirectional=not is_causal)
    q, k, v = (torch.randn(B, H, 130, D, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        want = relbias.attention(q, k, v, bias=bias, backend="reference", is_causal=is_causal, return_lse=True)
        got = relbias.attention(q.float(), k.float(), v.float(), bias=copy.deepcopy(bias).float(),
                                backend="toeplitz", is_causal=is_causal, return_lse=True)
    for name, g, w in zip(["out", "lse"], got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hb, is_causal", [(H, True), (1, False)])
def test_native_forward_results_are_bit_identical_across_runs(hb, is_causal, threads):
    torch.set_num_threads(threads)  # conftest restores it
    q, k, v, values = _forward_inputs(150, 150, hb, 0, is_causal, torch.float32)
    w = reversed_bias(values, torch.float32, 1.0, is_causal, 0, 150)
    plan = {"scale": D ** -0.5, "delta": 0, "is_causal": is_causal, "tile_q": 16, "tile_k": 24}
    first = _toeplitz_native.native_forward(q, k, v, w, plan)
    for _ in range(3):
        again = _toeplitz_native.native_forward(q, k, v, w, plan)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_forward_takes_non_contiguous_inputs(layout):
    q, k, v, values = _forward_inputs(20, 20, H, 0, True, torch.float64)
    w = reversed_bias(values, torch.float64, 1.0, True, 0, 20)
    plan = {"scale": D ** -0.5, "delta": 0, "is_causal": True, "tile_q": 8, "tile_k": 8}
    strided = [_strided(t, layout) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    assert all(_toeplitz_native.rows_layout(t) is t for t in strided)  # no copy
    got = _toeplitz_native.forward(*strided, w, plan)
    want = _toeplitz_native.forward(q, k, v, w, plan)
    # Other strides round differently (other GEMM leading dimensions, unaligned rows); the longest sum is over the
    # 20 keys.
    for g, x in zip(got, want):
        assert g.is_contiguous() and g.shape == x.shape
        assert_rounding_close(g, x, n=20)


def test_relbias_native_0_runs_the_flash_forward(monkeypatch):
    q, k, v, values = _forward_inputs(20, 20, H, 0, True, torch.float64)
    native = _forward_impl(q, k, v, values, None, D ** -0.5, 1.0, 0, True, 8, 5, 0.0, 0, 0, 0, -1, -1)
    monkeypatch.setenv("RELBIAS_NATIVE", "0")
    assert _toeplitz_native.forward(q, k, v, reversed_bias(values, torch.float64, 1.0, True, 0, 20), {}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit opt-out: nothing to warn about
        flash = _forward_impl(q, k, v, values, None, D ** -0.5, 1.0, 0, True, 8, 5, 0.0, 0, 0, 0, -1, -1)
    for g, w in zip(native, flash):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("is_causal", [True, False])
def test_native_forward_a_nan_query_reaches_only_that_query(is_causal):
    q, k, v, values = _forward_inputs(30, 30, H, 0, is_causal, torch.float32)
    q[1, 2, 17, 3] = float("nan")
    w = reversed_bias(values, torch.float32, 1.0, is_causal, 0, 30)
    plan = {"scale": D ** -0.5, "delta": 0, "is_causal": is_causal, "tile_q": 8, "tile_k": 16}
    out, lse = _toeplitz_native.native_forward(q, k, v, w, plan)
    bad = torch.zeros(B, H, 30, dtype=torch.bool)
    bad[1, 2, 17] = True
    assert bool(torch.isnan(out[bad]).all() and torch.isnan(lse[bad]).all())
    assert bool(torch.isfinite(out[~bad]).all() and torch.isfinite(lse[~bad]).all())


def test_the_kernels_refuse_rows_closer_than_head_dim_given_directly():
    """The C++ entry points check the layout themselves: rows 0 apart (a length broadcast) are refused, not read."""
    module = _toeplitz_native.load_native()
    q = torch.randn(B, H, 1, D, dtype=torch.float64).expand(B, H, 6, D)
    k = torch.randn(B, H, 6, D, dtype=torch.float64)
    w = torch.randn(H, 11, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="query must have unit stride along its last dimension"):
        module.toeplitz_forward(q, k, k, w, 0.3, 0, False, 4, 4, True)


def test_the_kernels_refuse_a_negative_view_given_directly():
    """A negative view (``torch._neg_view``) keeps its sign as a flag; the C++ entry points refuse it rather than read
    its memory without the sign."""
    module = _toeplitz_native.load_native()
    q = torch.randn(B, H, 6, D, dtype=torch.float64)
    w = torch.randn(H, 11, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="key must not be a negative view"):
        module.toeplitz_forward(q, torch._neg_view(q), q, w, 0.3, 0, False, 4, 4, True)


@pytest.mark.parametrize("negative", ["query", "key", "value"])
@pytest.mark.parametrize("lq, backend", [(3, "decode"), (3, "auto"), (12, "toeplitz")])
def test_a_negative_view_is_read_with_its_sign(negative, lq, backend):
    """Negative views (``torch._neg_view``: the sign a flag, the memory unnegated) of query, key or value give the
    reference's result, forward and backward, on a first call and on a repeat (decode keeps a native runner)."""
    if _toeplitz_native.load_native() is None:
        pytest.skip("the native kernels are not built here")
    relbias._repeat.forget()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, n, D, generator=g, dtype=torch.float64) for n in (lq, 20, 20))
    bias = relbias.T5Bias(num_heads=H, bidirectional=False).double()
    plain = dict(query=q, key=k, value=v)
    views = {**plain, negative: torch._neg_view(-plain[negative])}  # the same values, negated twice
    assert views[negative].is_neg() and torch.equal(views[negative].resolve_neg(), plain[negative])
    want = relbias.attention(*plain.values(), bias=bias, is_causal=True, backend="reference")
    with torch.no_grad():
        for _ in range(2):  # a first call, then a repeat of its signature
            got = relbias.attention(*views.values(), bias=bias, is_causal=True, backend=backend)
            assert_rounding_close(got, want, n=20)
    if backend == "toeplitz":  # the native backward reads them too
        leaves = {name: t.detach().requires_grad_() for name, t in plain.items()}
        relbias.attention(*leaves.values(), bias=bias, is_causal=True, backend="reference").sum().backward()
        negated = {name: (torch._neg_view(-t) if name == negative else t.clone()).requires_grad_()
                   for name, t in plain.items()}
        relbias.attention(*negated.values(), bias=bias, is_causal=True, backend=backend).sum().backward()
        for name in plain:
            assert_rounding_close(negated[name].grad, leaves[name].grad, n=20, msg=lambda m, n=name: f"d{n}: {m}")
