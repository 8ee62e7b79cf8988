"""The decode backend: a few queries against many keys (a decoding step, a short chunk), at the speed of
bias-free fused attention.

With Lq <= :data:`MAX_QUERIES`, the bias of the whole block is only (H, Lq, Lk). Two kernels run it:

* an offset-only bias, no mask, inputs the kernel reads in place (any but a length broadcast), where relbias'
  native kernels are built: the toeplitz backend's fused forward (``csrc/toeplitz_forward.cpp``), which reads the
  bias straight from the reversed per-offset vector;
* otherwise the bias looked up from the bias module (the native per-offset vector reversed, as a view, for
  offset-only families) and added, with the causal and user masks, to one additive ``attn_mask`` of PyTorch's CPU
  flash-attention kernel (through SDPA's binding, or the raw op when the log-sum-exp is asked for).

For the families whose values read their parameters alone (T5, per-offset, ALiBi, KERPLE), both read the reversed
per-offset values as a view into one table per bias (:mod:`relbias.backends._shared.offset_table`), grown
geometrically with the keys: the layers and steps of a decoder compute no bias until the keys outgrow it.

Nothing of K or V is copied or scanned: the native kernel keeps a NaN/inf in a key or value to the queries that see
it, and only for the flash path are the keys some query cannot see checked for NaN/inf (see
:attr:`relbias.call.AttentionCall.hidden_keys_finite`); a query with no visible key gets output 0 and lse -inf.

Inference only (neither kernel gives a gradient for the bias here); float32 and float64, and bfloat16 / float16 where
the native kernel runs them in half precision (:func:`relbias.backends.toeplitz._native.runs_half`: the CPU's matrix
units; the cache read in place, the bias in float32; a call the kernel cannot read in place runs on float32 copies).
Elsewhere half-precision calls go to the toeplitz backend (a half-precision mask would round the bias). Source:
split-KV decoding (Dao et al. 2023, Flash-Decoding) with the bias as an additive mask, as Hugging Face's T5 decoder
does with a materialised bias row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..biases.base import RelativeBias
from ..call import AttentionCall
from .toeplitz import _native as _toeplitz_native
from ._shared.cpu_flash import cpu_flash_reasons, fused_forward
from ._shared.offset_table import reversed_rows
from ._shared.reasons import dropout_reasons, non_finite_reasons, tensor_bias_reasons
from ._shared.dtypes import compute_dtype
from ._shared.window_keys import narrow_to_window
from .toeplitz._view import reversed_bias
from ..window import kernel_sides
from .base import Backend

__all__ = ["MAX_QUERIES", "DecodeBackend", "decode_attention"]

#: Most queries per call (tokens) the decode backend takes: its (B|1, H, Lq, Lk) additive mask stays small.
MAX_QUERIES = 16


def _additive_mask(call: AttentionCall, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(attn_mask (B|1, H|1, Lq, Lk) in ``dtype``: bias (scaled) + 0 / -inf, or None; visible (B|1, H|1, Lq, Lk)
    bool, or None when every query sees every key (a decoding step: queries on the last keys)."""
    a, device = call.alignment, call.query.device
    visible = None
    lo, hi = call.offset_band  # the causal rule (lo = 0) and the window
    if (lo is not None and a.min_offset < lo) or (hi is not None and a.max_offset > hi):  # some key lies outside
        offsets = a.offsets(device)
        inside = (offsets >= lo) if lo is not None else (offsets <= hi)
        if lo is not None and hi is not None:
            inside = inside & (offsets <= hi)
        visible = inside[None, None]
    add = _bias_block(call, dtype) if isinstance(call.bias, RelativeBias) else None
    mask = call.mask
    if mask is not None:
        seen = mask if mask.dtype == torch.bool else mask != float("-inf")
        visible = seen if visible is None else visible & seen
        if mask.is_floating_point():
            finite = mask.to(dtype).masked_fill(~seen, 0.0)
            add = finite if add is None else add + finite
    if visible is not None:
        base = add if add is not None else torch.zeros((), dtype=dtype, device=device)
        add = base.masked_fill(~visible, float("-inf"))
    return add, visible


def _bias_block(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor:
    """(1, Hb, Lq, Lk) scaled bias in ``dtype``. Offset-only families: read from the native per-offset values
    reversed, ``w[:, m]`` the bias at offset ``max_offset - m``, so entry (t, s) is ``w[:, Lq - 1 - t + s]``: a view
    with strides (1, 1) of rows in reverse order (a decoding step's one row is ``w`` itself), no gather."""
    a, bias = call.alignment, call.bias
    if not bias.offset_only:
        pe = bias(a.query_len, a.key_len, query_start=a.query_start, key_start=a.key_start)  # (Hb, Lq, Lk)
        return (pe.to(dtype) * call.bias_scale)[None]
    return _rows(_reversed(call).to(dtype), call)  # future offsets -inf, as ``visible`` masks them anyway


def _reversed(call: AttentionCall) -> torch.Tensor:
    """``w`` (Hb, Lq + Lk - 1) in the compute dtype of ``call.query`` (float32 for half precision) for an offset-only
    bias: the scaled per-offset values
    reversed, -inf at a causal call's future offsets; a view into the bias's table (:func:`reversed_rows`), shared by
    every layer and step, else computed once per native form, which a decoder's layers share within a step. Kept in
    the call's ``"decode_reversed"`` entry, which a repeat of the call's signature starts with."""
    return call._cached("decode_reversed", lambda: _compute_reversed(call))


def _compute_reversed(call: AttentionCall) -> torch.Tensor:
    dtype = compute_dtype(call.query.dtype)  # the bias never rounded to half precision
    w = reversed_rows(call, dtype)
    if w is not None:
        return w
    native = call.native_bias()
    a = call.alignment
    make = lambda: reversed_bias(native.values, dtype, call.bias_scale, call.is_causal, call.delta, a.key_len)
    return native.derive(("decode", dtype, call.bias_scale, call.is_causal), make)


def _rows(w: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """(1, Hb, Lq, Lk): entry (t, s) is ``w[:, Lq - 1 - t + s]`` of the reversed, scaled bias ``w``
    (Hb, Lq + Lk - 1)."""
    a = call.alignment
    rows = w.as_strided((w.shape[0], a.query_len, a.key_len), (w.stride(0), 1, 1))  # from w's own offset
    return (rows if a.query_len == 1 else rows.flip(1))[None]  # rows[:, r, s] = w[:, r + s], then query order


def decode_attention(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for a call :class:`DecodeBackend` accepts.

    Shapes: query (B, H, Lq, D) with Lq <= :data:`MAX_QUERIES`, key and value (B, H, Lk, D) -> out (B, H, Lq, D)
    in the dtype of ``query``, lse (B, H, Lq) in float32 (float64 for float64 inputs), -inf for a query with no
    visible key. Formula as :func:`relbias.attention`. With a window, only the keys some query's window reaches are
    read (:func:`~relbias.backends._shared.window_keys.narrow_to_window`): a decoding step with a window of W reads
    W keys of any cache.
    """
    call = narrow_to_window(call)
    if call.alignment.key_len == 0:  # every key is outside every query's window
        b, h, lq, _ = call.query.shape
        lse = torch.full((b, h, lq), float("-inf"), dtype=compute_dtype(call.query.dtype), device=call.query.device)
        return call.query.new_zeros(b, h, lq, call.value.shape[-1]), lse
    fused = _native_forward(call)
    if fused is not None:
        return fused
    query, key, value = call.query, call.key, call.value
    dtype = compute_dtype(query.dtype)
    if dtype != query.dtype:  # half precision the native kernel did not take (a length broadcast): float32 copies
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    attn_mask, visible = _additive_mask(call, dtype)
    if call.return_lse:
        out, lse = fused_forward(query, key, value, is_causal=False, scale=call.scale, attn_mask=attn_mask)
    else:  # SDPA's own binding runs the same CPU kernel a few µs sooner than the raw op (and reads any strides)
        out, lse = F.scaled_dot_product_attention(query, key, value, attn_mask, scale=call.scale), None
    out = out.to(call.query.dtype)
    if visible is not None:
        empty = ~visible.any(dim=-1)  # (B|1, H|1, Lq): the flash kernel returns out 0 and lse 0 there (math: NaN)
        out = out.masked_fill(empty[..., None], 0.0)
        lse = None if lse is None else lse.masked_fill(empty, float("-inf"))
    return out, lse


def _native_forward(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) by relbias' fused toeplitz forward kernel (``csrc/toeplitz_forward.cpp``: the bias read from the
    reversed per-offset vector, causal keys skipped; measured 5-25% faster than SDPA's kernel with the bias row as its
    mask, the most at Lk = 128), or None where it does not run: a mask, no bias or one that is not offset-only, a
    query, key or value the kernel would copy (:func:`~relbias.backends.toeplitz._native.read_in_place`; a static
    cache's view is read in place), under torch.compile (SDPA is one graph node), or where the native kernels do not
    run (not built: no warning)."""
    module = _native_module(call)
    if module is None:
        return None
    # positional: pybind11 spends about 1.3 us matching keyword arguments (a decoding step's kernel takes about 10)
    out, lse = module.toeplitz_forward(call.query, call.key, call.value, *_native_arguments(call))
    return out, lse


def _native_arguments(call: AttentionCall) -> tuple:
    """The native forward's arguments after q, k, v: the reversed bias, scale, positions, tiles, no padding or
    dropout, the window's sides. Kept in the call's ``"decode_native_arguments"`` entry (it holds the bias values:
    a repeat of a ``state_only`` bias's signature starts with it)."""
    return call._cached("decode_native_arguments", lambda: _compute_native_arguments(call))


def _compute_native_arguments(call: AttentionCall) -> tuple:
    a = call.alignment
    left, right = (-1, -1) if call.window is None else kernel_sides(call.window, a.min_offset, a.max_offset)
    return (_reversed(call), call.scale, call.delta, call.is_causal, _toeplitz_native.FORWARD_TILE_Q,
            _toeplitz_native.FORWARD_TILE_K, True, None, 0.0, 0, 0, 0, left, right)


def _native_module(call: AttentionCall):
    """The native extension when :func:`_native_forward` runs ``call`` (see there), else None; decided once per
    call, the part that follows from the call's signature (``"decode_native_takes"``) once per signature of a
    repeated call."""
    if not call._cached("decode_native_takes", lambda: _native_takes(call)):
        return None
    return call._cached("decode_native", lambda: _native_for(call.query, call.key, call.value))


def _native_takes(call: AttentionCall) -> bool:
    """Whether the native kernel takes a call of this signature: no mask, an offset-only bias module, CPU float32 /
    float64 inputs, not under torch.compile (SDPA is one graph node)."""
    bias = call.bias
    return (call.mask is None and isinstance(bias, RelativeBias) and bias.offset_only
            and _toeplitz_native.takes(call.query) and not torch.compiler.is_compiling())


def _native_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The extension where it is built (and not opted out of) and reads these inputs in place (strides: per call)."""
    return _toeplitz_native.load_native() if _toeplitz_native.read_in_place(query, key, value) else None


def _native_runner(call: AttentionCall):
    """:meth:`DecodeBackend.repeat_runner`: where the native kernel ran ``call``, the kernel call on new tensors
    with ``call``'s arguments, the extension's ``ForwardRepeat`` (csrc/toeplitz_repeat.cpp): it reads the strides and
    ``RELBIAS_NATIVE`` again on every call, as :func:`_native_for` does, and answers None where they keep the kernel
    from the tensors (the kernel confines NaN/inf in hidden keys, the flash path would not). A window that narrowed
    the keys ran the kernel on another call object, whose cache holds the decision: none here."""
    module = call._cache.get("decode_native")
    if module is None:
        return None
    w, scale, delta, is_causal, tile_q, tile_k, blas, _, _, _, _, _, left, right = _native_arguments(call)
    return module.ForwardRepeat(w, scale, delta, is_causal, tile_q, tile_k, blas, left, right)


class DecodeBackend(Backend):
    """Few queries against any number of keys: the bias rows read by one fused kernel call."""

    name = "decode"
    repeatable = True
    summary = (
        f"few queries (at most {MAX_QUERIES}): the bias rows read by one fused kernel call (relbias' native "
        f"toeplitz forward, or CPU flash attention with the rows as its mask), as fast as bias-free attention; "
        f"inference"
    )

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tensor_bias_reasons(call) + dropout_reasons(call, "the decode kernel")
        lq = call.alignment.query_len
        if lq > MAX_QUERIES:
            reasons.append(f"{lq} queries; the decode backend takes at most {MAX_QUERIES} (a decoding step or chunk)")
        if call.needs_grad:
            reasons.append(f"{call.grad_source}; the decode backend is inference only (no gradient for its bias mask)")
        if call.query.dtype not in (torch.float32, torch.float64) and not _toeplitz_native.takes(call.query):
            see = " (see the note)" if self.notes(call) else ""
            reasons.append(f"{call.query.dtype} inputs: the decode backend's additive bias mask would round the bias, "
                           f"and relbias' native kernel, which reads it in float32, does not run this dtype here{see}")
        reasons += cpu_flash_reasons(call)
        if reasons:
            return reasons
        return [] if self.confines_non_finite(call) else non_finite_reasons(narrow_to_window(call), "the decode kernel")

    def explain(self, call: AttentionCall) -> str:
        lq, lk = call.alignment.query_len, call.alignment.key_len
        if _native_module(narrow_to_window(call)) is not None:
            how = "relbias' native toeplitz forward, reading the bias rows from its per-offset values"
        elif call.bias is None and call.mask is None:
            how = "CPU flash attention, no bias"
        else:
            how = "CPU flash attention with the bias rows as its additive mask"
        rows = f"{lq} {'query' if lq == 1 else 'queries'} x {lk} {'key' if lk == 1 else 'keys'}"
        return f"{rows} in one fused kernel call ({how}), as fast as bias-free attention; inference"

    def notes(self, call: AttentionCall) -> list[str]:
        return _toeplitz_native.half_precision_notes(call.query)

    def confines_non_finite(self, call: AttentionCall) -> bool:
        # relbias' native kernel reads the values a row cannot see only to check them, and where one is NaN/inf it
        # multiplies each row by its own keys alone (csrc/toeplitz_forward.cpp, pv_product); CPU flash does not
        return _native_module(narrow_to_window(call)) is not None

    def repeat_runner(self, call: AttentionCall):
        return _native_runner(call)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_attention(call)
