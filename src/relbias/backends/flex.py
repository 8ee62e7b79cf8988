"""The FlexAttention backend: ``torch.nn.attention.flex_attention`` with the bias looked up per score.

``score_mod`` adds ``values[h, q_idx - kv_idx + Lk - 1]`` from the native per-offset vector (offset
``i - j = delta + q_idx - kv_idx``, ``min_offset = delta - (Lk - 1)``) and, for a float mask, its finite
values; ``mask_mod`` hides future keys (causal, under the block's alignment), False entries of a bool
mask and -inf entries of a float mask, so the block mask lets the kernel skip fully masked tiles. The
native values are a captured tensor, so the bias gradient flows where FlexAttention has a backward.

Needs ``torch.compile`` for a fused kernel (eager FlexAttention materialises the scores) and, in
torch 2.13, a device other than CPU for backward. :func:`flex_available` says which applies.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil

import torch

from ..biases.base import RelativeBias
from ..positions import Alignment

__all__ = ["flex_attention_backend", "flex_available"]

#: Compile FlexAttention (True) or run it eagerly (False: the same score_mod / mask_mod, unfused; tests
#: set it to check semantics without paying a compilation per shape).
COMPILE = True


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
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | None,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    convention: str,
    alignment: Alignment,
) -> torch.Tensor:
    """Attention with a relative bias through FlexAttention. Arguments are validated by the caller.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, Dv) -> (B, H, Lq, Dv) in the dtype of
    ``query``; formula as :func:`relbias.attention` (for "seed" the bias is multiplied by ``scale``).

    Raises:
        RuntimeError: FlexAttention cannot run here (see :func:`flex_available`).
        TypeError: ``bias`` is a tensor or a family that is not offset-only (no native vector to look up).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    needs_grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in (query, key, value))
        or (isinstance(bias, RelativeBias) and any(p.requires_grad for p in bias.parameters()))
    )
    ok, reason = flex_available(query.device, query.dtype, needs_grad)
    if not ok:
        raise RuntimeError(f"the flex backend cannot run: {reason}")
    if bias is not None and (not isinstance(bias, RelativeBias) or not bias.offset_only):
        raise TypeError("the flex backend looks the bias up in a native per-offset vector; it needs an offset-only bias module")

    from .blockwise import all_finite, blockwise_attention

    if 0 in (query.shape[0], query.shape[1], query.shape[3], value.shape[3]) or not all_finite(key, value):
        # FlexAttention divides by zero on empty axes, and spreads NaN/inf keys or values to queries that
        # cannot see them: the blockwise backend gives the empty result / confines them (same semantics).

        return blockwise_attention(
            query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale, convention=convention,
            alignment=alignment,
        )
    lq, lk = alignment.query_len, alignment.key_len
    delta = alignment.query_start - alignment.key_start
    values = None
    if bias is not None:
        values = bias.native(lq, lk, query_start=alignment.query_start, key_start=alignment.key_start, device=query.device).values
        values = values.float() * (scale if convention == "seed" else 1.0)  # (Hb, Lq + Lk - 1), logits
    shared = values is not None and values.shape[0] == 1
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    float_mask = mask4 is not None and mask4.is_floating_point()
    finite = mask4.masked_fill(mask4 == float("-inf"), 0.0).float() if float_mask else None
    visible = None if mask4 is None else (mask4 != float("-inf") if float_mask else mask4)

    def score_mod(score, b, h, q_idx, kv_idx):
        if values is not None:
            score = score + values[0 if shared else h, q_idx - kv_idx + (lk - 1)]
        if finite is not None:
            score = score + finite[b if finite.shape[0] > 1 else 0, h if finite.shape[1] > 1 else 0,
                                   q_idx if finite.shape[2] > 1 else 0, kv_idx if finite.shape[3] > 1 else 0]
        return score

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx - kv_idx + delta >= 0 if is_causal else q_idx >= 0
        if visible is not None:
            keep = keep & visible[b if visible.shape[0] > 1 else 0, h if visible.shape[1] > 1 else 0,
                                  q_idx if visible.shape[2] > 1 else 0, kv_idx if visible.shape[3] > 1 else 0]
        return keep

    block_mask = None
    if is_causal or visible is not None:
        batch = visible.shape[0] if visible is not None and visible.shape[0] > 1 else None
        heads = visible.shape[1] if visible is not None and visible.shape[1] > 1 else None
        block_mask = create_block_mask(mask_mod, batch, heads, lq, lk, device=query.device)
    run = _compiled() if COMPILE else flex_attention
    has_mod = values is not None or finite is not None
    return run(query, key, value, score_mod=score_mod if has_mod else None, block_mask=block_mask, scale=scale)
