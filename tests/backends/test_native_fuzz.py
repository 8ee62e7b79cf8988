"""Boundary fuzzing (hypothesis) of the toeplitz backend's native kernels: the built extension's ``toeplitz_forward``
and ``toeplitz_backward`` called directly (every argument drawn, inputs read in place), and the custom ops
``relbias::toeplitz_forward`` / ``toeplitz_backward`` on top of them, each against a float64 formula written out here:
scores, the bias gathered per (query, key), the band of ``tests/_window_band.py``, the key padding, the dropout mask
of :class:`relbias._dropout.Dropout`, a softmax; gradients by autograd.

Drawn: float64 (float32 sometimes); batch and heads 0-3; lengths 0-70 around the tiles' and vector lanes' multiples;
tiles from 1 key to longer than the lengths; head dims 0, 1, ..., 256 and 300 (the kernels set no upper bound);
inputs as offset views into larger tensors whose other entries are NaN (a read outside a view shows), transposed
projections and broadcast batches and heads; the bias table as a row-strided view into a NaN table or an exact
allocation (a read past it: ASan); key padding rows that keep no key, only the last, only the first, a prefix, a
suffix or any; delta at the ends of the table (no query sees a key ... every query sees every key); window sides of
0, 1 and more than the lengths; dropout (p up to 0.9, absolute positions near 2**31 and 2**32) over tiles as small
as one key; one or two threads; the BLAS or at::addmm_out. Results are compared within the rounding tolerance of
``tests/_tolerance.py`` for the dtype and the reduction length.

Under the normal build this checks the boundaries in a few seconds; ``.ci/sanitize`` runs it against the kernels
built with AddressSanitizer and UBSan, where an out-of-bounds access or undefined behaviour aborts the run.
``RELBIAS_FUZZ_EXAMPLES`` sets the examples per test (default 80).

The forward also in bfloat16 and float16 (q, k, v in half precision, the bias and padding in float32; on a CPU with
AMX-BF16 the bfloat16 calls of 64 query rows or more run the packed brgemm path), against the formula on the same
rounded inputs within the rounding of P and of the output to that dtype.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relbias._dropout import Dropout
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias.backends.toeplitz._kernel import toeplitz_backward, toeplitz_forward

from .._tolerance import max_abs, rounding_tolerance
from .._window_band import band

NATIVE = _toeplitz_native.load_native()
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"native toeplitz kernels unavailable: "
                                                       f"{_toeplitz_native.native_unavailable_reason()}")
SETTINGS = settings(max_examples=int(os.environ.get("RELBIAS_FUZZ_EXAMPLES", "80")), deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65]  # around 8 and 16 lanes, 64-byte sums
DIMS = [0, 1, 3, 8, 17, 64, 256, 300]
TILES = [1, 2, 3, 5, 8, 16, 64, 512]
POSITIONS = [0, 7, 2**31 - 3, -(2**31), 2**32 - 2]  # dropout's absolute positions wrap modulo 2**32
NAN = float("nan")


@st.composite
def problems(draw, ops: bool = False):
    """Sizes and settings of one call (``ops``: through the custom ops, whose native forward needs both lengths)."""
    tiles = [draw(st.sampled_from(TILES)) for _ in range(3)]  # forward rows, forward keys, backward (ops: block_q)

    def length(tile):
        near = [m * tile + r for m in (1, 2, 3) for r in (-1, 0, 1)]  # remainders around the tile
        return draw(st.sampled_from(sorted({n for n in LENGTHS + near if 1 <= n <= 70})))

    lq, lk = length(tiles[0]), length(tiles[1] if not ops else tiles[2])
    if not ops:  # an empty side at times (the table then has Lq + Lk - 1 >= 0 entries)
        empty = draw(st.sampled_from([None] * 12 + ["lq", "lk"]))
        lq, lk = (0 if empty == "lq" else lq), (0 if empty == "lk" else lk)
    b, h = draw(st.sampled_from([1, 2] * 5 + [0])), draw(st.sampled_from([1, 2, 3] * 3 + [0]))  # empty at times
    side = st.sampled_from([-1, -1, 0, 1, 2, lq + lk + 5]) | st.integers(0, 70)
    ends = [-lq - 1, -lq, 1 - lq, 0, lk - 1, lk, lk + 3]
    layouts = ["contiguous", "sliced", "transposed", "expanded"] + (["strided_last"] if ops else [])
    return types.SimpleNamespace(
        b=b, h=h, lq=lq, lk=lk, d=draw(st.sampled_from(DIMS)), dv=draw(st.sampled_from(DIMS)),
        hb=draw(st.sampled_from([1, h])) if h else 1, tiles=tiles,
        dtype=draw(st.sampled_from([torch.float64] * 3 + [torch.float32])),
        is_causal=draw(st.sampled_from([True, False])),
        delta=draw(st.sampled_from(ends) | st.integers(-lq - 2, lk + 2)),
        window=(draw(side), draw(side)), scale=draw(st.sampled_from([None, 1.0, 0.0, 0.3])),
        bias_size=draw(st.sampled_from([1.0, 4.0, 40.0])), bias_scale=draw(st.sampled_from([1.0, 0.5, -2.0])),
        padding=draw(st.none() | st.lists(st.sampled_from(["all", "none", "last", "first", "prefix", "suffix", "any"]),
                                          min_size=1, max_size=b * h or 1)),
        dropout=(draw(st.sampled_from([0.0, 0.0, 0.2, 0.5, 0.9])), draw(st.integers(0, 2**31 - 1)),
                 draw(st.sampled_from(POSITIONS) | st.integers(-(2**33), 2**33)),
                 draw(st.sampled_from(POSITIONS) | st.integers(-(2**33), 2**33))),
        layouts=[draw(st.sampled_from(layouts)) for _ in range(3)] + [draw(st.sampled_from(layouts[:3])) for _ in
                                                                       range(3)],  # q, k, v; dO, out, lse
        w_sliced=draw(st.booleans()), threads=draw(st.sampled_from([1, 2])), blas=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (B, H, L, D) in ``layout``: contiguous; sliced (an offset view into a larger tensor of NaN); transposed (a
    (B, L, H, D) projection's view); strided_last (unit stride along L, not D: the ops copy it)."""
    if layout == "sliced":
        parent = torch.full((x.shape[0], x.shape[1], x.shape[2] + 3, x.shape[3] + 5), NAN, dtype=x.dtype)
        view = parent[:, :, 2:x.shape[2] + 2, 1:x.shape[3] + 1]
        return view.copy_(x)
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided_last":
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    return x.contiguous()


def _input(c, g, length: int, dim: int, layout: str) -> torch.Tensor:
    """A random (B, H, length, dim) input of ``c``'s dtype in ``layout`` ("expanded": one batch and head, broadcast)."""
    if layout == "expanded":
        return torch.randn(1, 1, length, dim, generator=g, dtype=torch.float64).to(c.dtype).expand(c.b, c.h, -1, -1)
    return _laid_out(torch.randn(c.b, c.h, length, dim, generator=g, dtype=torch.float64).to(c.dtype), layout)


def _keep(c, g) -> torch.Tensor | None:
    """(Bm, Hm, Lk) bool, True = key kept: one row per drawn kind, Bm and Hm 1 or B and H as the kinds' count fits."""
    if c.padding is None:
        return None
    rows = len(c.padding)
    bm, hm = (c.b, c.h) if rows == c.b * c.h and rows > 1 else (1, 1)
    kinds = c.padding if (bm, hm) != (1, 1) else c.padding[:1]
    j = torch.arange(c.lk)
    cut = int(torch.randint(0, c.lk + 1, (), generator=g))
    made = {"all": j >= 0, "none": j < 0, "last": j == c.lk - 1, "first": j == 0, "prefix": j < cut,
            "suffix": j >= cut, "any": torch.rand(c.lk, generator=g) < 0.6}
    return torch.stack([made[kind] for kind in kinds]).reshape(bm, hm, c.lk)


def reference(q, k, v, bias, keep, visible, scale, z):
    """(out, lse, p, largest |score|) in float64: softmax over the visible (band) and kept keys of ``scale q k^T +
    bias``; ``z`` the dropout factors (None: none) applied to p before p v; a query with no such key gets out 0 and lse
    -inf."""
    seen = visible if keep is None else visible & keep[:, :, None, :]
    seen = seen.expand(q.shape[0], q.shape[1], -1, -1)
    s = (scale * q @ k.transpose(-2, -1) + bias).masked_fill(~seen, float("-inf"))
    some = seen.any(-1, keepdim=True)
    m = (s.detach().amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)).masked_fill(~some, 0)
    e = torch.exp(s - m)
    total = torch.where(some, e.sum(-1, keepdim=True), torch.ones_like(m))
    p = e / total
    out = (p if z is None else p * z) @ v
    lse = torch.where(some, m + torch.log(total), torch.full_like(m, float("-inf"))).squeeze(-1)
    return out, lse, p.detach(), max_abs(s.detach())


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy of ``t`` (contiguous, broadcast dimensions materialised) that requires grad."""
    return t.detach().to(torch.float64, copy=True).contiguous().requires_grad_()


def _check(c, got, want, q, k, v, dout, glse, p, z, gathered, smax):
    """``got`` (out, lse, dq, dk, dv, grad of the bias table) against ``want`` (the reference's), each within the
    rounding tolerance of the call's dtype and reduction length, the gradients' scale a bound on their terms (a
    gradient that cancels still carries its terms' rounding); exactly 0 and -inf for a query that sees no key."""
    out, lse = got[:2]
    no_key = want[1] == float("-inf")
    assert torch.equal(lse == float("-inf"), no_key) and not out[no_key].any()
    pz = p if z is None else p * z
    zmax = 1.0 if z is None else 1.0 / (1.0 - c.dropout[0])
    with torch.no_grad():
        r = max_abs((dout @ v.transpose(-2, -1)) * (1.0 if z is None else z)) + max_abs((dout * want[0]).sum(-1))
        r += max_abs(glse)
        diagonals = torch.zeros_like(want[5]).requires_grad_()
    (per_offset,) = torch.autograd.grad((gathered(diagonals) * p).sum(), diagonals)
    columns = max_abs(p.sum(-2))
    n = max(c.d, c.dv, c.lq, c.lk, 1)
    bounds = [max_abs(v) * zmax, smax + max_abs(want[1]), abs(c.scale) * r * max_abs(k),
              abs(c.scale) * r * max_abs(q) * columns, max_abs(dout) * max_abs(pz.sum(-2)), r * max_abs(per_offset)]
    lengths = [n, n, n, n, n, max(c.b * c.h, 1) * n * n]
    for name, g, w, bound, length in zip(["out", "lse", "dq", "dk", "dv", "bias"], got, want, bounds, lengths):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        atol, rtol = rounding_tolerance(w, n=length, dtype=c.dtype, scale=max(bound, max_abs(w)))
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def _setup(c):
    """Tensors and the pieces of the formula shared by both tests."""
    g = torch.Generator().manual_seed(c.seed)
    q, k = _input(c, g, c.lq, c.d, c.layouts[0]), _input(c, g, c.lk, c.d, c.layouts[1])
    v = _input(c, g, c.lk, c.dv, c.layouts[2])
    c.scale = (c.d ** -0.5 if c.d else 1.0) if c.scale is None else c.scale
    keep = _keep(c, g)
    left, right = (None if s < 0 else s for s in c.window)
    visible = band(c.lq, c.lk, c.delta, 0, (left, right), c.is_causal)
    p_drop, seed, query_start, key_start = c.dropout
    z = None if p_drop == 0 else Dropout(p_drop, seed, query_start, key_start).scale_tile(
        c.b, c.h, 0, c.lq, 0, c.lk, "cpu", torch.float64)
    offsets = torch.arange(c.lk)[None, :] - torch.arange(c.lq)[:, None]  # j - i
    return g, q, k, v, keep, visible, z, offsets


def _additive(keep, dtype):
    return None if keep is None else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@SETTINGS
@given(c=problems())
def test_the_kernels_match_the_float64_formula(c):
    """The extension's entry points, every argument drawn; w is the reversed bias: query i, key j reads
    w[Lq - 1 - i + j], -inf at a causal call's future offsets."""
    g, q, k, v, keep, visible, z, offsets = _setup(c)
    m = c.lq + c.lk - 1
    w = torch.randn(c.hb, m, generator=g, dtype=torch.float64).mul_(c.bias_size).to(c.dtype)
    if c.is_causal:
        w[:, max(0, c.lq + c.delta):] = float("-inf")
    table = w
    if c.w_sliced:  # a row-strided view into a longer table of NaN
        table = torch.full((c.hb, m + 5), NAN, dtype=c.dtype)[:, 2:m + 2].copy_(w)
    index = c.lq - 1 + offsets
    kpad = _additive(keep, c.dtype)
    settings_ = (c.dropout[0], c.dropout[1], c.dropout[2], c.dropout[3], *c.window)
    before = _threads(c.threads)
    try:
        out, lse = NATIVE.toeplitz_forward(q, k, v, table, c.scale, c.delta, c.is_causal, c.tiles[0], c.tiles[1],
                                           c.blas, kpad, *settings_)
        dout = _laid_out(torch.randn(out.shape, generator=g, dtype=torch.float64).to(c.dtype), c.layouts[3])
        glse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(c.dtype).masked_fill(lse == -torch.inf, 0)
        lse_in = lse if c.layouts[5] == "contiguous" else _laid_out(lse[..., None], "sliced")[..., 0]
        grads = NATIVE.toeplitz_backward(dout, q, k, v, _laid_out(out, c.layouts[4]), lse_in, glse, w, c.scale,
                                         c.delta, c.is_causal, c.tiles[2], c.blas, kpad, *settings_)
    finally:
        torch.set_num_threads(before)
    q64, k64, v64, w64 = (_leaf(t) for t in (q, k, v, w))
    gathered = lambda t: t[:, index][None]  # noqa: E731 - (1, Hb, Lq, Lk)
    ref_out, ref_lse, p, smax = reference(q64, k64, v64, gathered(w64), keep, visible, c.scale, z)
    loss = (dout.double() * ref_out).sum() + (glse.double() * ref_lse.masked_fill(ref_lse == -torch.inf, 0)).sum()
    want = [ref_out.detach(), ref_lse.detach(), *torch.autograd.grad(loss, (q64, k64, v64, w64), allow_unused=True,
                                                                     materialize_grads=True)]
    read = torch.zeros(max(m, 0), dtype=torch.bool)
    read[index[visible]] = True  # the offsets some visible pair reads; the rest of grad_w is unspecified
    got = [out, lse, *grads[:3], grads[3].masked_fill(~read, 0)]
    want[5] = want[5].masked_fill(~read, 0)
    _check(c, got, want, q64.detach(), k64.detach(), v64.detach(), dout.double(), glse.double(), p, z, gathered,
           smax)


@SETTINGS
@given(c=problems(ops=True))
def test_the_custom_ops_match_the_float64_formula(c):
    """``relbias::toeplitz_forward`` / ``toeplitz_backward`` (their Python glue: the reversed bias, the tiles a
    window gets, the layouts they copy): ``values`` (Hb, Lq + Lk - 1), strided, column n the bias of i - j = n - (Lk
    - 1), times bias_scale; block_q and tile drawn."""
    g, q, k, v, keep, visible, z, offsets = _setup(c)
    m = c.lq + c.lk - 1
    values = torch.randn(m, c.hb, generator=g, dtype=torch.float64).mul_(c.bias_size).to(c.dtype).t()
    index = c.lk - 1 - offsets
    kpad = _additive(keep, c.dtype)
    if kpad is not None and kpad.shape[:2] == (1, 1) and c.b * c.h > 1:
        kpad = kpad.expand(c.b, c.h, -1)  # a full-size padding row, broadcast (the ops make it contiguous)
    p_drop, seed, query_start, key_start = c.dropout  # the ops take the seed as a tensor (drawn in a graph)
    settings_ = (c.scale, c.bias_scale, c.delta, c.is_causal, c.tiles[0], c.tiles[2], p_drop, torch.tensor(seed),
                 query_start, key_start, *c.window)
    before = _threads(c.threads)
    try:
        out, lse = toeplitz_forward(q, k, v, values, kpad, *settings_)
        dout = _laid_out(torch.randn(out.shape, generator=g, dtype=torch.float64).to(c.dtype), c.layouts[3])
        glse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
        grads = toeplitz_backward(dout, glse, q, k, v, values, kpad, out, lse, *settings_, True)
    finally:
        torch.set_num_threads(before)
    q64, k64, v64, values64 = (_leaf(t) for t in (q, k, v, values))
    gathered = lambda t: c.bias_scale * t[:, index][None]  # noqa: E731
    ref_out, ref_lse, p, smax = reference(q64, k64, v64, gathered(values64), keep, visible, c.scale, z)
    finite_lse = ref_lse.masked_fill(ref_lse == -torch.inf, 0)
    loss = (dout.double() * ref_out).sum() + (glse.double() * finite_lse).sum()
    want = [ref_out.detach(), ref_lse.detach(), *torch.autograd.grad(loss, (q64, k64, v64, values64),
                                                                     materialize_grads=True)]
    glse_seen = glse.double().masked_fill(ref_lse == -torch.inf, 0)
    _check(c, [out, lse, *grads], want, q64.detach(), k64.detach(), v64.detach(), dout.double(), glse_seen, p, z,
           gathered, smax)


def _half_setup(c, half):
    """``_setup``'s tensors in ``half``, the reversed bias ``w`` (Hb, Lq + Lk - 1) in float32 (-inf at a causal
    call's future offsets) and the kernels' dropout and window arguments."""
    c.dtype = half
    g, q, k, v, keep, visible, z, offsets = _setup(c)
    w = torch.randn(c.hb, c.lq + c.lk - 1, generator=g, dtype=torch.float64).mul_(c.bias_size).float()
    if c.is_causal:
        w[:, max(0, c.lq + c.delta):] = float("-inf")
    return g, q, k, v, keep, visible, z, offsets, w, (*c.dropout, *c.window)


@SETTINGS
@given(c=problems(), half=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16]))
def test_the_half_precision_forward_matches_the_float64_formula(c, half):
    """The forward entry point with half-precision q, k, v (w and the key padding float32): out within a few units
    of the dtype at the values' scale (P and the output are rounded to it), lse within float32's rounding (scores,
    softmax statistics and bias stay float32)."""
    g, q, k, v, keep, visible, z, offsets, w, settings_ = _half_setup(c, half)
    table = w if not c.w_sliced else torch.full((c.hb, w.shape[1] + 5), NAN)[:, 2:w.shape[1] + 2].copy_(w)
    before = _threads(c.threads)
    try:
        out, lse = NATIVE.toeplitz_forward(q, k, v, table, c.scale, c.delta, c.is_causal, c.tiles[0], c.tiles[1],
                                           c.blas, _additive(keep, torch.float32), *settings_)
    except RuntimeError as error:  # a libtorch without MKL's half-precision GEMM refuses by name
        assert "half-precision GEMM" in str(error)
        return
    finally:
        torch.set_num_threads(before)
    assert out.dtype == half and lse.dtype == torch.float32
    index = c.lq - 1 + offsets
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref_out, ref_lse, _, smax = reference(q64, k64, v64, w.double()[:, index][None], keep, visible, c.scale, z)
    no_key = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), no_key) and not out[no_key].any()
    zmax = 1.0 if z is None else 1.0 / (1.0 - c.dropout[0])
    atol = 4 * torch.finfo(half).eps * max_abs(v64) * zmax
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    atol, rtol = rounding_tolerance(ref_lse, n=max(c.d, c.lk, 1), dtype=torch.float32, scale=smax + max_abs(ref_lse))
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=rtol)


@SETTINGS
@given(c=problems(), half=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16]))
def test_the_half_precision_backward_matches_the_float64_formula(c, half):
    """The backward entry point with half-precision dout, q, k, v and out (lse, grad_lse, w and the key padding
    float32): dq, dk, dv (in the dtype; P and dS rounded to it for their GEMMs) and the bias table's gradient
    (float32) against the float64 formula's on the same rounded inputs, within the dtype's rounding at the
    gradients' scale."""
    g, q, k, v, keep, visible, z, offsets, w, settings_ = _half_setup(c, half)
    m = w.shape[1]
    kpad = _additive(keep, torch.float32)
    before = _threads(c.threads)
    try:
        out, lse = NATIVE.toeplitz_forward(q, k, v, w, c.scale, c.delta, c.is_causal, c.tiles[0], c.tiles[1],
                                           c.blas, kpad, *settings_)
        dout = _laid_out(torch.randn(out.shape, generator=g, dtype=torch.float64).to(half), c.layouts[3])
        glse = torch.randn(lse.shape, generator=g, dtype=torch.float64).float().masked_fill(lse == -torch.inf, 0)
        grads = NATIVE.toeplitz_backward(dout, q, k, v, _laid_out(out, c.layouts[4]), lse, glse, w, c.scale,
                                         c.delta, c.is_causal, c.tiles[2], c.blas, kpad, *settings_)
    except RuntimeError as error:  # a libtorch without MKL's half-precision GEMM refuses by name
        assert "half-precision GEMM" in str(error)
        return
    finally:
        torch.set_num_threads(before)
    assert [t.dtype for t in grads] == [half, half, half, torch.float32]
    q64, k64, v64, w64 = (_leaf(t) for t in (q, k, v, w))
    gathered = lambda t: t[:, c.lq - 1 + offsets][None]  # noqa: E731 - (1, Hb, Lq, Lk)
    ref_out, ref_lse, p, smax = reference(q64, k64, v64, gathered(w64), keep, visible, c.scale, z)
    loss = (dout.double() * ref_out).sum() + (glse.double() * ref_lse.masked_fill(ref_lse == -torch.inf, 0)).sum()
    want = [ref_out.detach(), ref_lse.detach(), *torch.autograd.grad(loss, (q64, k64, v64, w64), allow_unused=True,
                                                                     materialize_grads=True)]
    read = torch.zeros(max(m, 0), dtype=torch.bool)
    read[(c.lq - 1 + offsets)[visible]] = True  # the offsets some visible pair reads; the rest is unspecified
    got = [out, lse, *grads[:3], grads[3].masked_fill(~read, 0)]
    want[5] = want[5].masked_fill(~read, 0)
    bounds = _half_gradient_bounds(half, c.scale, q64.detach(), k64.detach(), v64.detach(), dout.double(),
                                   want[0], glse.double(), p, z, gathered, w64)
    for name, g_, w_, bound in zip(["dq", "dk", "dv", "bias"], got[2:], want[2:], bounds):
        unit = torch.finfo(half).eps if name != "bias" else 64 * torch.finfo(torch.float32).eps
        terms = max_abs(bound) / unit + max_abs(w_)  # the products' scale
        rounded = 0.5 * torch.finfo(half).eps * w_.abs() if name != "bias" else 0.0  # the result in the dtype
        excess = (g_.double() - w_).abs() - bound - rounded - 1e-4 * terms  # 1e-4: float32 sums of <= 300 terms
        assert max(excess.max().item() if excess.numel() else 0.0, 0.0) == 0, f"{name}: {excess.max():.3g} past"


def _half_gradient_bounds(half, scale, q, k, v, dout, out, glse, p, z, gathered, table):
    """Elementwise bounds on a half-precision backward's dq, dk, dv and bias-table gradient against the float64
    formula: P and dS rounded to the dtype for the dq, dk, dv GEMMs (relative eps / 2 each; eps is used); the bias
    gradient sums the float32 dS (D from the backward's own P, not from the rounded output), so float32's rounding:
    64 float32 eps of the summed |dS| per offset."""
    eps, s = torch.finfo(half).eps, abs(scale)
    pz = p if z is None else p * z
    dp = dout @ v.transpose(-2, -1)
    d = (dout * out).sum(-1, keepdim=True) - glse[..., None]
    ds = (p * ((dp if z is None else dp * z) - d)).abs()
    bq = eps * s * ds @ k.abs()
    bk = eps * s * ds.transpose(-2, -1) @ q.abs()
    bv = eps * pz.abs().transpose(-2, -1) @ dout.abs()
    diagonals = torch.zeros_like(table).requires_grad_()
    (bw,) = torch.autograd.grad((gathered(diagonals) * ds).sum(), diagonals)  # |dS| summed per offset
    return bq, bk, bv, 64 * torch.finfo(torch.float32).eps * bw