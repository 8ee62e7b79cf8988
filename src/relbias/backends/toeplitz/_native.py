"""The toeplitz backend's forward and its backward with a bias gradient as fused C++ kernels, built on first use.

:func:`forward` returns what the PyTorch path of :func:`relbias.backends.toeplitz._kernel._forward_impl` returns
(out and lse), computed by ``csrc/toeplitz_forward.cpp``: the FlashAttention-2 forward (Dao 2023, Alg. 1), an online
softmax over key tiles per (batch x head, query tile) task, the bias read straight from the reversed per-offset
vector, a causal call's key tiles beyond the diagonal skipped. The PyTorch path calls the CPU flash kernel once per
query block with the bias as a strided mask (read per tile, and a causal block computes its whole diagonal block).

:func:`backward` returns what :func:`relbias.backends.toeplitz._backward.tiled_backward` returns (dq, dk, dv and
the gradient of the reversed bias ``w``), computed by ``csrc/toeplitz_backward.cpp``: the FlashAttention-2 backward
(Dao 2023, Alg. 2) over (query tile, key tile) pairs, parallel over batch x heads, with the scores, ``P``, ``dS``
and the bias gradient's diagonal sums formed in one elementwise pass per tile (a polynomial ``exp`` that the
compiler vectorises) between single-threaded GEMMs. The Python version makes about eight elementwise passes per
tile. Results are deterministic (the per-(batch, head) bias-gradient rows are summed in a fixed order).

Both kernels are one extension module (``csrc/*.cpp`` and the shared ``csrc/toeplitz_common.h``), obtained by
:func:`relbias.backends.toeplitz._build.build`: an ahead-of-time module installed with the package, else a build on
first use (``-O3 -march=native -fopenmp``, cached per machine kind; the first build, about 50 s on 2 cores, is
announced through :mod:`logging`), else, for a compiler without OpenMP, a single-threaded build.

Fallback: when the build or load fails, or the environment sets ``RELBIAS_NATIVE=0``, or the inputs are not CPU
float32 / float64, :func:`backward` runs the Python ``tiled_backward`` (same results up to rounding) and
:func:`forward` returns None (the caller runs the CPU flash kernel per query block); a failed build warns once per
kernel (``RuntimeWarning`` naming the error), the explicit ``RELBIAS_NATIVE=0`` does not.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .._shared.denormals import flush_denormals
from .._shared.dtypes import compute_dtype
from ._build import build as _build
from ._backward import tiled_backward

__all__ = [
    "FORWARD_TILE_K", "FORWARD_TILE_Q", "HALF_UNITS", "backward", "forward", "forward_tiles", "half_precision_note",
    "half_precision_notes", "load_native", "loaded_native", "window_tile", "native_backward", "native_forward",
    "native_unavailable_reason", "native_variant", "read_in_place", "rows_layout", "runs_half", "takes",
]

#: The native forward's query rows and keys per tile (tokens), each capped by the call's ``block_q``
#: (:func:`forward_tiles`). Measured at 4096 tokens (B=1, H=8, D=64, float32, 1 thread, a shared 2-core machine, so
#: roughly): 128 x 256 tiles ran 1.3-1.7x bias-free SDPA causal; 256 x 512 1.0-1.08x causal and bidirectional (T5,
#: ALiBi), where the flash path ran 1.07-1.22x.
FORWARD_TILE_Q = 256
FORWARD_TILE_K = 512
_LOCK = threading.Lock()
_loaded: dict[str, object] = {}  # "module" and "variant", or "error", once the build was tried
_warned: set[tuple[str, str]] = set()  # (what fell back, why): warned once
_OPT_OUT = "RELBIAS_NATIVE=0 is set"


def load_native():
    """The built extension module (with ``toeplitz_forward``, ``toeplitz_backward`` and ``has_blas``), building it
    on the first call; None when ``RELBIAS_NATIVE=0`` is set or the build failed (see
    :func:`native_unavailable_reason`). The build is tried once per process."""
    if native_unavailable_reason() is not None:
        return None
    return _loaded.get("module")


@torch.compiler.assume_constant_result  # a compiled graph asks once, when traced: the build runs outside the graph
def native_unavailable_reason() -> str | None:
    """Why the native kernel is not used (``RELBIAS_NATIVE=0``, or the build's error), or None when it is; the
    first call builds or loads it."""
    if os.environ.get("RELBIAS_NATIVE", "").strip() == "0":
        return _OPT_OUT
    if not _loaded:
        with _LOCK:
            if not _loaded:
                try:
                    _loaded["module"], _loaded["variant"] = _build()
                except Exception as error:  # no compiler, no ninja, a compile error: the Python version runs
                    _loaded["error"] = f"building it failed ({type(error).__name__}: {str(error).strip()[:500]})"
    return _loaded.get("error")


def native_variant() -> str | None:
    """Which build of the kernels runs (e.g. ``"ahead-of-time build for x86_64_v4"``, ``"built on first use
    (-march=native, OpenMP)"``), or None where none does (:func:`native_unavailable_reason` says why); the first call
    builds or loads it."""
    return None if native_unavailable_reason() is not None else _loaded["variant"]


def _fall_back(reason: str, what: str = "backward runs in Python") -> None:
    if (what, reason) not in _warned:
        _warned.add((what, reason))
        warnings.warn(f"relbias: the toeplitz {what}, not the native kernel: {reason}", RuntimeWarning, stacklevel=3)


def _runs(query: torch.Tensor, what: str) -> bool:
    """Whether the native kernels take a call on ``query``'s dtype and device (CPU float32 / float64) and are built;
    a failed build warns once that ``what`` (e.g. "backward runs in Python") instead. ``RELBIAS_NATIVE=0``: no
    warning (asked for)."""
    if not takes(query):
        return False
    reason = native_unavailable_reason()
    if reason is not None and reason != _OPT_OUT:
        _fall_back(reason, what)
    return reason is None


def loaded_native(query: torch.Tensor):
    """The built extension module when the native kernels take calls on ``query``'s dtype and device (CPU float32 /
    float64), else None, without a warning (the caller has another path as fast as the fallbacks); the first call
    builds or loads it."""
    return load_native() if takes(query) else None


_NATIVE_DTYPES = (torch.float32, torch.float64)
_HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: The matrix units a half-precision dtype's native forward runs on, for the messages (names as ``lscpu`` shows them).
HALF_UNITS = {torch.bfloat16: "AMX-BF16 (amx_bf16)", torch.float16: "AMX-FP16 (amx_fp16)"}
_half_answers: dict[tuple[torch.dtype, bool], bool] = {}  # (dtype, oneDNN on) -> the module's half_precision answer


def takes(query: torch.Tensor) -> bool:
    """Whether the native forward takes a call on ``query``'s dtype and device: CPU float32 / float64, and bfloat16 /
    float16 where :func:`runs_half` (the forward and the backward)."""
    if not query.is_cpu:  # is_cpu: a decoding step's check, without a device object
        return False
    dtype = query.dtype
    return dtype in _NATIVE_DTYPES or (dtype in _HALF_NAMES and runs_half(dtype))


@torch.compiler.assume_constant_result  # asked once when traced, as native_unavailable_reason
def runs_half(dtype: torch.dtype) -> bool:
    """Whether the native forward runs ``dtype`` (``torch.bfloat16`` or ``torch.float16``) in half precision here:
    the kernels are built and not opted out of, libtorch exports the half-precision GEMM (MKL's
    ``cblas_gemm_bf16bf16f32`` / ``cblas_gemm_f16f16f32``), and the CPU has the matrix units for it as oneDNN sees
    them (:data:`HALF_UNITS`: ATen's ``cpublas::could_pack``, as its CPU flash attention decides; lowered by
    ``ONEDNN_MAX_CPU_ISA`` and ``torch.backends.mkldnn``). Elsewhere half-precision inputs run on float32 copies:
    without those units a half-precision GEMM is no faster than float32's, and slower on AVX2. False for any other
    dtype; the first call builds the kernels."""
    name = _HALF_NAMES.get(dtype)
    if name is None or load_native() is None:
        return False
    key = (dtype, torch._C._get_mkldnn_enabled())  # torch.backends.mkldnn.flags(enabled=False) turns the units off
    answer = _half_answers.get(key)
    if answer is None:
        answer = _half_answers[key] = bool(_loaded["module"].half_precision(name))
    return answer


def half_precision_notes(query: torch.Tensor) -> list[str]:
    """For a CPU call in bfloat16 or float16, ``[half_precision_note(dtype)]`` (the note ``explain_backend`` gives
    once for the toeplitz and decode backends); else ``[]``."""
    note = half_precision_note(query.dtype) if query.is_cpu else None
    return [] if note is None else [note]


def half_precision_note(dtype: torch.dtype) -> str | None:
    """For ``dtype`` bfloat16 or float16, a sentence saying whether the native forward runs it in half precision
    here and on what (the matrix units, or float32 copies and why); None for other dtypes."""
    if dtype not in _HALF_NAMES:
        return None
    units = HALF_UNITS[dtype]
    if runs_half(dtype):
        return f"{_HALF_NAMES[dtype]} runs in half precision on the CPU's {units} tiles (float32 softmax and bias)"
    why = native_unavailable_reason()
    if why is None:
        why = (f"oneDNN finds no {units} on this CPU (ATen's CPU capability {torch.backends.cpu.get_cpu_capability()})"
               f" or libtorch exports no half-precision GEMM")
    return f"{_HALF_NAMES[dtype]} runs on float32 copies: {why}"


def _module(what: str):
    """The built extension, for the native ``what`` ("forward", "backward"); RuntimeError where it is unavailable."""
    module = load_native()
    if module is None:
        raise RuntimeError(f"the native toeplitz {what} is unavailable: {native_unavailable_reason()}")
    return module


def read_in_place(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels read every (B, H, L, D) tensor of ``tensors`` without a copy: its last dimension has
    unit stride and its rows lie at least D apart (a slice along L, the transpose of a (B, L, H, D) projection, a
    static cache's view, a broadcast batch or head; not a length broadcast, whose rows are 0 apart), and is not a
    negative view (``torch._neg_view``: its sign is a flag the kernels, reading memory, would not apply)."""
    for tensor in tensors:
        if tensor.is_neg():
            return False
        if tensor.is_contiguous():  # the common case, without reading strides
            continue
        _, _, length, dim = tensor.shape
        if not ((dim <= 1 or tensor.stride(3) == 1) and (length <= 1 or tensor.stride(2) >= dim)):
            return False
    return True


def rows_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A (B, H, L, D) ``tensor`` as the native kernels read it: itself where :func:`read_in_place`, else a contiguous
    copy (a negative view's sign applied)."""
    return tensor if read_in_place(tensor) else tensor.resolve_neg().contiguous()


def backward(
    do: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, grad_lse: torch.Tensor | None, w: torch.Tensor, plan: dict, *,
    key_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, grad_w) for the toeplitz forward by the native kernel, or by the Python ``tiled_backward`` where
    it is unavailable (a failed build warns once); arguments and results as ``tiled_backward``'s.

    Shapes: ``do``, ``query``, ``out`` (B, H, Lq, D) and ``key``, ``value`` (B, H, Lk, D), float32 or float64 on
    CPU (any strides: read in place where :func:`rows_layout` allows, else copied); ``lse`` (B, H, Lq) float32 /
    float64, -inf for a query that sees no key;
    ``grad_lse`` None or like ``lse``; ``w`` (Hb, Lq + Lk - 1), Hb 1 or H, the reversed scaled bias (-inf at a
    causal call's future offsets). ``plan``: scale, delta, is_causal, tile (rows and keys per tile, tokens).
    ``key_padding``: None or the key padding mask as an additive (Bm, Hm, Lk) row, 0 or -inf (Bm 1 or B, Hm 1 or H).
    Returns contiguous dq, dk, dv like the inputs and ``grad_w`` (Hb, Lq + Lk - 1) in the inputs' dtype (values at
    future offsets: unspecified, the caller zeroes them). Source: FlashAttention-2 backward (Dao 2023, Alg. 2).
    """
    if not _runs(query, "backward runs in Python"):
        with flush_denormals():  # the Python pass; the native kernels flush on their own threads
            return tiled_backward(do, query, key, value, out, lse, grad_lse, w, plan, key_padding=key_padding)
    return native_backward(do, query, key, value, out, lse, grad_lse, w, plan, key_padding=key_padding)


def native_backward(do, query, key, value, out, lse, grad_lse, w, plan, *, blas: bool = True, key_padding=None):
    """:func:`backward` by the native kernel only (raises RuntimeError where it is unavailable). ``blas``: GEMMs
    through the BLAS that libtorch exports (MKL's sgemm_ / dgemm_) when present, else through at::addmm_out
    (False: always at::addmm_out; for tests). ``plan`` may also hold the attention dropout's ``dropout_p``, ``seed``,
    ``query_start`` and ``key_start`` (:class:`relbias._dropout.Dropout`; ``out`` is then the dropped output) and a
    window's ``window_left`` and ``window_right`` (:func:`relbias.window.kernel_sides`: -1 for no bound; the Python
    pass of :func:`backward` has no window, so a windowed call needs the native kernels)."""
    module = _module("backward")
    dtype = query.dtype
    acc = compute_dtype(dtype)
    tensors = [rows_layout(t.to(dtype)) for t in (do, query, key, value, out)] + [lse.to(acc)]
    grad_lse = None if grad_lse is None else grad_lse.to(acc)
    dq, dk, dv, grad_w = module.toeplitz_backward(
        *tensors, grad_lse, w.to(acc).contiguous(), float(plan["scale"]), int(plan["delta"]),
        bool(plan["is_causal"]), int(plan["tile"]), blas, _padding(key_padding, acc), *_dropout(plan),
        *_window(plan),
    )
    return dq, dk, dv, grad_w


def forward_tiles(block_q: int, width: int | None = None) -> tuple[int, int]:
    """(query rows, keys) per tile of the native forward: :data:`FORWARD_TILE_Q` and :data:`FORWARD_TILE_K`, each
    capped by the call's ``block_q`` (the flash path's query rows per kernel call), so that small settings (tests)
    give small tiles. The backward's ``tile`` plays no part: the forward wants wider key tiles. ``width``: a
    window's band of offsets (keys a query may see), when bounded: query tiles then shrink to about a quarter of it
    (:func:`window_tile`), so that a tile's keys are not much more than its rows' windows."""
    cap = max(1, int(block_q))
    return min(cap, window_tile(FORWARD_TILE_Q, width)), min(cap, FORWARD_TILE_K)


def window_tile(tile: int, width: int | None) -> int:
    """``tile`` (rows per tile, tokens), or for a window whose rows see ``width`` keys at most, the power of two
    nearest below ``width / 4`` if smaller (at least 32): a tile of T rows reads T + width - 1 keys for T * width
    visible scores, 1.25x them at T = width / 4 where T = width would read 2x."""
    if width is None:
        return tile
    return min(tile, max(32, 1 << max(0, (width // 4).bit_length() - 1)))


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, w: torch.Tensor,
            plan: dict, *, key_padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) of the toeplitz attention by the native kernel, or None where it does not run (not CPU float32 /
    float64 or a half precision :func:`runs_half` takes, an empty length, ``RELBIAS_NATIVE=0``, or a failed build:
    that warns once); the caller then runs the CPU flash kernel per query block.

    Shapes: ``query`` (B, H, Lq, D), ``key`` (B, H, Lk, D), ``value`` (B, H, Lk, Dv), one dtype, any strides
    (read in place where :func:`rows_layout` allows, else copied); ``w`` (Hb, Lq + Lk - 1), Hb 1 or H, the reversed
    scaled bias (-inf at a causal call's future offsets), read in the inputs' accumulation dtype (float32 for
    bfloat16 and float16: the bias is never rounded to half precision). ``plan``: scale, delta, is_causal, tile_q,
    tile_k (query rows and keys per tile). ``key_padding``: as :func:`backward`'s; a key tile whose keys are all
    padded is skipped. Returns contiguous out (B, H, Lq, Dv) in the inputs' dtype and lse (B, H, Lq) in their
    accumulation dtype, -inf (out 0) for a query that sees no key. Half precision: ``q kᵀ`` and ``P v`` on
    half-precision operands (P rounded, as ATen's CPU flash attention does) with float32 accumulation; scores,
    softmax, dropout and the output accumulator in float32. Source: FlashAttention-2 forward (Dao 2023, Alg. 1).
    """
    if key.dtype != query.dtype or value.dtype != query.dtype or query.shape[2] == 0 or key.shape[2] == 0:
        return None
    if not _runs(query, "forward runs PyTorch's flash kernel per query block"):
        return None
    return native_forward(query, key, value, w, plan, key_padding=key_padding)


def native_forward(query, key, value, w, plan, *, blas: bool = True, key_padding=None):
    """:func:`forward` by the native kernel only (raises RuntimeError where it is unavailable); ``blas`` and the
    dropout settings ``plan`` may hold as in :func:`native_backward`."""
    module = _module("forward")
    dtype = query.dtype
    acc = compute_dtype(dtype)
    q, k, v = (rows_layout(t.to(dtype)) for t in (query, key, value))
    out, lse = module.toeplitz_forward(
        q, k, v, w.to(acc).contiguous(), float(plan["scale"]), int(plan["delta"]), bool(plan["is_causal"]),
        int(plan["tile_q"]), int(plan["tile_k"]), blas, _padding(key_padding, acc), *_dropout(plan),
        *_window(plan),
    )
    return out, lse


def _dropout(plan: dict) -> tuple[float, int, int, int]:
    """The kernels' dropout arguments from a plan: (dropout_p, seed, query_start, key_start); p 0: none."""
    return (float(plan.get("dropout_p", 0.0)), int(plan.get("seed", 0)), int(plan.get("query_start", 0)),
            int(plan.get("key_start", 0)))


def _window(plan: dict) -> tuple[int, int]:
    """The kernels' window arguments from a plan: (window_left, window_right), -1 for no bound on a side
    (:func:`relbias.window.kernel_sides`); a plan without them has no window."""
    return int(plan.get("window_left", -1)), int(plan.get("window_right", -1))


def _padding(key_padding: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive key padding as the kernels read it: ``dtype``, contiguous (None stays None)."""
    return None if key_padding is None else key_padding.to(dtype).contiguous()
