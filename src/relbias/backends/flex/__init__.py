"""The FlexAttention backend: ``torch.nn.attention.flex_attention`` with the bias looked up per score.

``score_mod`` adds ``values[h, q_idx - kv_idx + Lk - 1]`` from the native per-offset vector (offset
``i - j = delta + q_idx - kv_idx``) and, for a float mask, its finite values; ``mask_mod`` hides future
keys (causal, under the block's alignment), keys outside a local-attention window (:mod:`relbias.window`:
offsets ``-right <= i - j <= left``), False entries of a bool mask and -inf entries of a float mask, so
the block mask lets the kernel skip fully masked tiles: with a window, every tile outside the band is
never visited. The native values are a captured tensor, so the bias gradient flows where FlexAttention
has a backward; with a window they are evaluated only inside the band (:meth:`AttentionCall.native_bias`).

Compiled per length bucket: query and key lengths are padded to the next power of two (at least
:data:`MIN_BUCKET`; padded keys are masked, padded queries dropped), and positions reach
``score_mod`` / ``mask_mod`` as tensors, never as Python numbers baked into the graph. A new length or
decode step inside a bucket therefore reuses the compiled kernel, and a run of growing lengths compiles
O(log L) times. A window's sides reach ``mask_mod`` as tensors too: only which sides bound the block
shapes the graph, so another window width reuses it. (``dynamic=True`` is not used: torch 2.13's CPU
FlexAttention template fails to compile with symbolic lengths.) Should dynamo still hit its recompile
limit (:data:`RECOMPILE_LIMIT`), the call raises instead of falling back to eager FlexAttention, which
would materialise the (B, H, Lq, Lk) scores.

Never silently wrong: compiled FlexAttention in torch 2.13 returns wrong values or NaN on some CPUs
(AVX2 without AVX-512, head_dim 8 or 16: the last (batch, head) slice). Before its first use per
(device, dtype, head_dim, value head_dim), the compiled kernel is checked against SDPA on small probe
problems; where it disagrees, the backend refuses such calls and says why (:func:`kernel_check`).

On a GPU in half precision the kernels get block sizes that fit its shared memory, with one retry at smaller
blocks when inductor finds no configuration that fits (:mod:`._options`).

Needs ``torch.compile`` for a fused kernel (eager FlexAttention materialises the scores) and, in
torch 2.13, a device other than CPU for backward. :func:`flex_available` says which applies.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import shutil

import torch

from ...biases.base import RelativeBias
from ...call import AttentionCall
from ...window import kernel_sides
from . import _blocks as _flex_blocks
from . import _options as _flex_options
from ..base import Backend
from .._shared.reasons import (
    dropout_reasons, empty_axis_reasons, non_finite_reasons, small_block_reasons, tensor_bias_reasons,
)

__all__ = ["FlexBackend", "flex_attention", "flex_available", "kernel_check"]

#: Compile FlexAttention (True) or run it eagerly (False: the same score_mod / mask_mod, unfused; tests
#: set it to check semantics without paying a compilation per shape).
COMPILE = True

#: Smallest padded length (tokens); lengths are padded to max(MIN_BUCKET, next power of two).
MIN_BUCKET = 16
#: Compiled variants dynamo may keep for FlexAttention (length buckets x shapes x mask kinds).
RECOMPILE_LIMIT = 64

#: Probe problems (batch, num_heads, length, trials) of :func:`kernel_check`: the first is where torch
#: 2.13's CPU kernel was seen to fail (AVX2, head_dim 8 and 16: wrong values or NaN in the last (batch,
#: head) slice, not on every run), the second is a length bucket as calls run it.
PROBES = ((2, 4, 40, 4), (1, 3, 64, 1))
#: On CPUs without AVX-512, head dims below this are refused without probing (torch 2.13 gets 8 and 16
#: wrong there, intermittently, so a probe could pass by chance).
MIN_AVX2_HEAD_DIM = 32

#: (device type, device index, dtype, head_dim, value head_dim) -> None (the compiled kernel agrees with
#: SDPA) or the reason it does not.
_CHECKED: dict[tuple, str | None] = {}

#: (device type, device index, dtype, head_dim, value head_dim, backward) -> (the device's shared memory per block,
#: the ``kernel_options`` half-precision calls on that GPU compile with (:mod:`._options`), whether a compile with
#: them has been retried: once per key and process, the smaller options kept).
_OPTIONS: dict[tuple, tuple[int, dict, bool]] = {}
#: Padded query lengths below this run inductor's FlexAttention decoding kernel, which sizes its query block from the
#: length itself (a ``fwd_BLOCK_M`` would override it past the rows that exist): those calls get no forward options.
DECODING_BELOW = 128


def flex_available(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> tuple[bool, str]:
    """Whether the FlexAttention backend can run here, and why (not).

    Args:
        device: device of the inputs.
        dtype: their dtype.
        needs_grad: whether a gradient will be asked for (inputs or bias parameters require grad).

    Returns:
        (ok, reason), reason a sentence.
    """
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False, f"this PyTorch ({torch.__version__}) has no torch.nn.attention.flex_attention"
    if device.type == "cpu" and needs_grad:
        return False, f"FlexAttention has no backward on CPU in torch {torch.__version__}"
    if device.type not in ("cpu", "cuda", "xpu"):
        return False, f"FlexAttention does not run on {device.type}"
    if COMPILE:
        if device.type == "cpu" and shutil.which("c++") is None and shutil.which("g++") is None:
            return False, "torch.compile on CPU needs a C++ compiler and none is on PATH"
        if device.type == "cpu" and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False, f"compiled FlexAttention on CPU takes float32/float16/bfloat16, not {dtype}"
        if device.type == "cuda" and importlib.util.find_spec("triton") is None:
            return False, "torch.compile on CUDA needs triton, which is not installed"
    return True, f"FlexAttention{' (compiled)' if COMPILE else ' (eager)'} on {device.type}"


@functools.lru_cache(maxsize=1)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


def _kernel_options(query: torch.Tensor, value: torch.Tensor, backward: bool) -> tuple[tuple | None, dict | None]:
    """(key of :data:`_OPTIONS`, the kernel_options of this call) for a half-precision call on a GPU; (None, None)
    elsewhere, where inductor's defaults stay. Below :data:`DECODING_BELOW` padded queries, the backward's only."""
    key = (query.device.type, query.device.index, query.dtype, query.shape[-1], value.shape[-1], backward)
    if key not in _OPTIONS:
        found = _flex_options.for_call(query.device, query.dtype, query.shape[-1], value.shape[-1], backward)
        if found is None:
            return None, None
        _OPTIONS[key] = (*found, False)
    options = _OPTIONS[key][1]
    if query.shape[-2] < DECODING_BELOW:
        options = {k: v for k, v in options.items() if not k.startswith("fwd_")} or None
    return key, options


def _compile_and_call(q, k, v, kernel_options, backward, **kwargs):
    """The compiled FlexAttention call, the backward lowered with the forward when it will run (so that its compile
    errors, too, surface here)."""
    if kernel_options is not None:
        kwargs["kernel_options"] = kernel_options
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=RECOMPILE_LIMIT), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=backward):
        return _compiled()(q, k, v, **kwargs)


def _run(q, k, v, *, backward: bool = False, **kwargs):
    """FlexAttention, compiled (a recompile-limit hit raises) or eager when COMPILE is off.

    On a GPU in half precision the kernels get block sizes that fit its shared memory (:mod:`._options`); a compile
    that runs out of shared memory anyway is retried once (per dtype, head dims and ``backward``, in the process) with
    smaller blocks, which later calls keep. ``backward``: gradients will be asked for (the backward's options are
    chosen and its compilation checked too)."""
    if not COMPILE:
        from torch.nn.attention.flex_attention import flex_attention as flex

        return flex(q, k, v, **kwargs)
    key, options = _kernel_options(q, v, backward)
    try:
        try:
            return _compile_and_call(q, k, v, options, backward, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise
        except Exception as error:
            factor = _flex_options.retry_factor(error) if key is not None else None
            if factor is None or options is None or _OPTIONS[key][2]:
                raise
            memory, kept, _ = _OPTIONS[key]
            smaller = _flex_options.shrink(kept, memory, q.dtype, q.shape[-1], v.shape[-1], factor)
            _OPTIONS[key] = (memory, smaller, True)
            _, options = _kernel_options(q, v, backward)
            return _compile_and_call(q, k, v, options, backward, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        raise RuntimeError(
            "compiled FlexAttention hit dynamo's recompile limit; relbias refuses to fall back to eager "
            "FlexAttention, which materialises the (B, H, Lq, Lk) scores (use backend='blockwise')"
        ) from exc


def kernel_check(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int) -> str | None:
    """Check compiled FlexAttention against SDPA once per (device, dtype, head_dim, value_dim).

    On a CPU without AVX-512, head dims below :data:`MIN_AVX2_HEAD_DIM` are refused outright. Otherwise
    runs bias-free attention on the :data:`PROBES` shapes (random inputs, fixed seed), forward only, and
    compares with SDPA computed in float64 (tolerance 1e-4 for float32, 3e-2 for half types, relative to
    the largest value). Costs two compilations the first time; the answer is cached for the process.

    Returns:
        None when every probe agrees; otherwise the reason, naming torch's version, the CPU capability,
        head_dim and the error found (a wrong value, or the compiler's exception: a probe that fails to compile
        is a refusal, not an error of the call).
    """
    key = (device.type, device.index, dtype, head_dim, value_dim)
    if key in _CHECKED:
        return _CHECKED[key]
    capability = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device.type
    if device.type == "cpu" and not capability.startswith("AVX512") and min(head_dim, value_dim) < MIN_AVX2_HEAD_DIM:
        _CHECKED[key] = (
            f"compiled FlexAttention in torch {torch.__version__} returns wrong values or NaN on CPUs without "
            f"AVX-512 (here {capability}) for small head dims (seen: 8 and 16); head_dim {head_dim} and value "
            f"head_dim {value_dim} must be >= {MIN_AVX2_HEAD_DIM} here"
        )
        return _CHECKED[key]
    generator = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    reason = None
    with torch.no_grad():
        for batch, heads, length, trials in PROBES:
            for _ in range(trials):
                q, k = (torch.randn(batch, heads, length, head_dim, generator=generator) for _ in range(2))
                v = torch.randn(batch, heads, length, value_dim, generator=generator)
                want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
                q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
                try:
                    got = _run(q, k, v, scale=1.0 / math.sqrt(head_dim)).double().cpu()
                except Exception as error:  # inductor cannot compile it here (e.g. no vector ISA for CPU flex)
                    reason = (
                        f"compiled FlexAttention in torch {torch.__version__} does not compile here ({capability}, "
                        f"{dtype}, head_dim {head_dim}): {type(error).__name__}: {str(error).strip()[:300]}"
                    )
                    break
                error = (got - want).abs().max().item() if got.numel() else 0.0
                if not math.isfinite(error) or error > tolerance * max(1.0, want.abs().max().item()):
                    reason = (
                        f"compiled FlexAttention in torch {torch.__version__} returns wrong values here ({capability}, "
                        f"{dtype}, head_dim {head_dim}): max error {error:.3g} against SDPA on a ({batch}, {heads}, "
                        f"{length}, {head_dim}) probe"
                    )
                    break
            if reason:
                break
    _CHECKED[key] = reason
    return reason


def _index(t: torch.Tensor, b, h, q_idx, kv_idx):
    """Entry of a 4-D broadcastable tensor at (b, h, q_idx, kv_idx); size-1 dimensions broadcast."""
    return t[b if t.shape[0] > 1 else 0, h if t.shape[1] > 1 else 0,
             q_idx if t.shape[2] > 1 else 0, kv_idx if t.shape[3] > 1 else 0]


def bucket(length: int) -> int:
    """The padded length (tokens) FlexAttention is compiled for: max(:data:`MIN_BUCKET`, next power of two)."""
    return max(MIN_BUCKET, 1 << max(0, length - 1).bit_length())


def _pad_to(t: torch.Tensor, dim: int, size: int, fill=0, *, broadcast: bool = False) -> torch.Tensor:
    """``t`` padded with ``fill`` along ``dim`` to ``size``; unchanged when it has that size, or size 1 there
    and ``broadcast`` (a mask dimension that broadcasts)."""
    n = t.shape[dim]
    if n == size or (broadcast and n == 1):
        return t
    shape = list(t.shape)
    shape[dim] = size - n
    return torch.cat([t, t.new_full(shape, fill)], dim=dim)


def flex_attention(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with a relative bias through FlexAttention, on a call :class:`FlexBackend` accepts.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, Dv) -> out (B, H, Lq, Dv) in the dtype
    of ``query`` and lse (B, H, Lq) float32 (float64 for float64 inputs, as the bias and the mask's finite values),
    -inf for a query with no visible key (None unless
    ``call.return_lse``); formula as :func:`relbias.attention` (for "seed" the bias is multiplied by
    ``scale``). Inputs are padded to :func:`bucket` lengths (copies of O(B·H·L·D)).

    Raises:
        RuntimeError: dynamo hit its recompile limit (see the module docstring).
    """
    query, key, value, bias, mask, alignment = call.query, call.key, call.value, call.bias, call.mask, call.alignment
    device = query.device
    lq, lk = alignment.query_len, alignment.key_len
    pq, pk = bucket(lq), bucket(lk)
    # Per-call numbers reach score_mod / mask_mod as tensors, so the compiled graph depends on the bucket only.
    delta = torch.tensor(call.delta, device=device)
    key_len = torch.tensor(lk, device=device)
    # The window's sides (i - j <= left, j - i <= right), -1 where a side hides no key of this block, and the right
    # side under the causal rule, which bounds it at 0 already. Only which sides bound (Python bools) shapes the
    # compiled graph; their values are tensors.
    left, right = kernel_sides(call.window, alignment.min_offset, alignment.max_offset)
    if call.is_causal:
        right = -1
    has_left, has_right = left >= 0, right >= 0
    left_t = torch.tensor(left, device=device) if has_left else None
    right_t = torch.tensor(right, device=device) if has_right else None
    values = None
    accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
    if bias is not None:
        native = call.native_bias()  # with a window, evaluated only inside its band
        # Column n = q_idx - kv_idx + (pk - 1) of the padded vector holds offset delta + q_idx - kv_idx, i.e.
        # native column n - (pk - lk); padded entries are 0 (their keys are masked, their queries dropped).
        values = torch.zeros(native.values.shape[0], pq + pk - 1, dtype=accumulate, device=device)
        values[:, pk - lk : pk - lk + lq + lk - 1] = native.values.to(accumulate) * call.bias_scale  # logits
    shared = values is not None and values.shape[0] == 1
    float_mask = mask is not None and mask.is_floating_point()
    finite = visible = None
    if mask is not None:
        finite = mask.masked_fill(mask == float("-inf"), 0.0).to(accumulate) if float_mask else None
        visible = mask != float("-inf") if float_mask else mask
        visible = _pad_to(_pad_to(visible, 2, pq, False, broadcast=True), 3, pk, False, broadcast=True)
        finite = None if finite is None else _pad_to(_pad_to(finite, 2, pq, broadcast=True), 3, pk, broadcast=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        if values is not None:
            score = score + values[0 if shared else h, q_idx - kv_idx + (pk - 1)]
        if finite is not None:
            score = score + _index(finite, b, h, q_idx, kv_idx)
        return score

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx < key_len
        if call.is_causal:
            keep = keep & (q_idx - kv_idx + delta >= 0)
        if has_left:
            keep = keep & (q_idx - kv_idx + delta <= left_t)
        if has_right:
            keep = keep & (kv_idx - q_idx - delta <= right_t)
        if visible is not None:
            keep = keep & _index(visible, b, h, q_idx, kv_idx)
        return keep

    def visible_rows(t0, t1):  # mask_mod for query rows t0:t1, as a (Bm, Hm, t1 - t0, pk) bool tensor
        keys = torch.arange(pk, device=device)
        keep = (keys < lk).expand(t1 - t0, pk)
        if call.is_causal or has_left or has_right:
            offsets = torch.arange(t0, t1, device=device)[:, None] - keys + call.delta
            if call.is_causal:
                keep = keep & (offsets >= 0)
            if has_left:
                keep = keep & (offsets <= left)
            if has_right:
                keep = keep & (-offsets <= right)
        keep = keep[None, None]
        if visible is not None:
            keep = keep & (visible[:, :, t0:t1] if visible.shape[2] > 1 else visible)
        return keep

    batch, heads = (1, 1) if visible is None else visible.shape[:2]
    block_mask = _flex_blocks.block_mask(mask_mod, visible_rows, batch, heads, pq, pk, device)
    has_mod = values is not None or finite is not None
    q, k, v = _pad_to(query, 2, pq), _pad_to(key, 2, pk), _pad_to(value, 2, pk)
    kwargs = dict(score_mod=score_mod if has_mod else None, block_mask=block_mask, scale=call.scale,
                  backward=call.needs_grad)
    if not call.return_lse:  # compiled FlexAttention on CPU has no return_lse in torch 2.13
        return _run(q, k, v, **kwargs)[:, :, :lq], None
    from torch.nn.attention import flex_attention as flex_module

    if hasattr(flex_module, "AuxRequest"):  # torch >= 2.9: return_lse is deprecated
        out, aux = _run(q, k, v, return_aux=flex_module.AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:
        out, lse = _run(q, k, v, return_lse=True, **kwargs)
    return out[:, :, :lq], lse[:, :, :lq].to(accumulate)


class FlexBackend(Backend):
    """FlexAttention with the bias in ``score_mod``: offset-only biases, any mask; forward only on CPU."""

    name = "flex"
    repeatable = True
    summary = "FlexAttention (torch.compile, per length bucket) with the bias looked up per score; memory O(N·D)"

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tensor_bias_reasons(call) + dropout_reasons(call, "FlexAttention")
        bias = call.bias
        if isinstance(bias, RelativeBias) and not bias.offset_only:
            reasons.append(f"{type(bias).__name__} reads absolute positions; the flex backend looks up a per-offset vector")
        reasons += empty_axis_reasons(call, "FlexAttention")
        ok, why = flex_available(call.query.device, call.query.dtype, call.needs_grad)
        if not ok:
            reasons.append(why)
        if call.return_lse and COMPILE and call.query.device.type == "cpu":
            reasons.append(f"compiled FlexAttention on CPU does not return the log-sum-exp in torch {torch.__version__}")
        if reasons:
            return reasons
        if not call.hidden_keys_finite:
            return non_finite_reasons(call, "FlexAttention")
        if COMPILE:
            failed = kernel_check(call.query.device, call.query.dtype, call.query.shape[-1], call.value.shape[-1])
            if failed:
                return [failed]
        return []

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        if small_block_reasons(call):
            return small_block_reasons(call)
        if call.query.device.type != "cuda":
            return [f"auto takes flex on CUDA only (on {call.query.device.type}, structured or blockwise run without compiling)"]
        if call.needs_grad:
            return [
                f"{call.grad_source} and flex's CUDA backward is not yet verified against the reference "
                "(benchmarks/gpu_check.py); pass backend='flex' to use it anyway"
            ]
        return []

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return flex_attention(call)
