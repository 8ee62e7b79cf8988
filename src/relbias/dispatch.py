"""Which attention backend runs a call, and why.

``relbias.attention(..., backend="auto")`` (the default) asks :func:`choose_backend`; an explicitly named
backend is checked by :func:`check_backend` and refused with the reason when it cannot run the call.
:func:`explain_backend` answers the same question for a user without running anything.

Backends (``relbias.backends.BACKENDS``):

* ``"reference"``: materialises the (B, H, Lq, Lk) scores; the oracle; runs everything.
* ``"blockwise"``: tiled, memory O(B·H·L·D), any device and dtype, every bias module and mask.
* ``"structured"``: far-constant biases (T5, clipped per-offset), no mask or a bool key padding mask,
  where a fused kernel with log-sum-exp exists (CPU): bias-free fused attention far from the diagonal
  plus a tiled band.
* ``"flex"``: FlexAttention (compiled), offset-only biases; forward only on CPU in torch 2.13.
"""

from __future__ import annotations

import torch

from . import _checks
from .backends._fused import fused_available
from .backends.flex import flex_available
from .backends.structured import far_distance, key_padding_mask
from .biases.base import RelativeBias
from .positions import Alignment

__all__ = ["AUTO_REFERENCE_MAX_SCORES", "check_backend", "choose_backend", "explain_backend"]

#: "auto" materialises (uses the reference) when B·H·Lq·Lk is at most this many scores (16 MiB in
#: float32): below it tiling costs more Python overhead than it saves.
AUTO_REFERENCE_MAX_SCORES = 1 << 22


def _needs_grad(query, key, value, bias, mask) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [query, key, value]
    if isinstance(bias, RelativeBias):
        tensors += list(bias.parameters())
    elif isinstance(bias, torch.Tensor):
        tensors.append(bias)
    return any(t.requires_grad for t in tensors)


def check_backend(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | torch.Tensor | None,
    mask: torch.Tensor | None,
    is_causal: bool,
    alignment: Alignment,
) -> tuple[bool, str]:
    """Whether backend ``name`` can run this (validated) call; (ok, reason), reason a sentence.

    Arguments as :func:`relbias.attention` (query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, Dv)).
    """
    if name == "reference":
        return True, "the reference runs every call"
    if isinstance(bias, torch.Tensor):
        return False, "the bias is a tensor, already materialised (O(N^2)); only the reference takes it"
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        return False, "the float mask requires grad; only the reference back-propagates into a mask"
    if name == "blockwise":
        return True, "tiled attention in PyTorch: any device, dtype, bias module and mask"
    if name == "structured":
        if bias is None:
            return False, "there is no bias; bias-free attention needs no band (use blockwise or SDPA)"
        if not isinstance(bias, RelativeBias) or not bias.offset_only:
            return False, f"{type(bias).__name__} reads absolute positions, so it is not constant far from the diagonal"
        if far_distance(bias) is None:
            return False, (
                f"{type(bias).__name__} is not constant beyond a distance (T5Bias and PerOffsetBias with "
                f"out_of_range='clip' are)"
            )
        if mask is not None and key_padding_mask(mask, key.shape[2]) is None:
            return False, (
                "the mask is not a bool key padding mask (B or 1, H or 1, 1, Lk); the fused far parts take only "
                "that (float masks and masks with a query dimension go to blockwise)"
            )
        if value.shape[-1] != query.shape[-1]:
            return False, f"value head_dim {value.shape[-1]} differs from query head_dim {query.shape[-1]}; the fused kernel needs them equal"
        if alignment.query_len == 0 or alignment.key_len == 0:
            return False, "an empty query or key block"
        return fused_available(query.device, query.dtype)
    if name == "flex":
        if bias is not None and (not isinstance(bias, RelativeBias) or not bias.offset_only):
            return False, f"{type(bias).__name__} reads absolute positions; the flex backend looks up a per-offset vector"
        if alignment.query_len == 0 or alignment.key_len == 0:
            return False, "an empty query or key block"
        return flex_available(query.device, query.dtype, _needs_grad(query, key, value, bias, mask))
    return True, f"{name!r} is a registered backend without a capability check"


def choose_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | torch.Tensor | None,
    mask: torch.Tensor | None,
    is_causal: bool,
    alignment: Alignment,
) -> tuple[str, str]:
    """The backend "auto" runs for this (validated) call, by device, dtype, grad mode, bias family and shape.

    Returns:
        (name, reason). Policy: a tensor bias or a mask requiring grad -> reference; at most
        :data:`AUTO_REFERENCE_MAX_SCORES` scores -> reference; CUDA -> flex when it can run and no gradient
        is needed (blockwise when one is: flex's CUDA backward awaits a GPU check); then structured
        when the bias is far-constant and the mask is None or a bool key padding mask; else blockwise.
    """
    def check(name):
        return check_backend(
            name, query, key, value, bias=bias, mask=mask, is_causal=is_causal, alignment=alignment
        )

    ok, reason = check("blockwise")
    if not ok:
        return "reference", reason
    b, h, lq, _ = query.shape
    scores = b * h * lq * alignment.key_len
    if scores <= AUTO_REFERENCE_MAX_SCORES:
        return "reference", f"small block: {scores} scores (<= {AUTO_REFERENCE_MAX_SCORES}) are cheaper to materialise"
    if query.device.type == "cuda":
        ok, why = check("flex")
        if ok and not _needs_grad(query, key, value, bias, mask):
            return "flex", f"{why}: fused kernel with the bias looked up per score"
        if ok:  # flex's backward (bias-table gradients included) has not been checked on a GPU yet
            return "blockwise", (
                "gradients are needed and flex's CUDA backward is not yet verified against the reference "
                "(benchmarks/gpu_check.py); blockwise is; pass backend='flex' to use it anyway"
            )
    ok, why = check("structured")
    if ok:
        masked = "no mask" if mask is None else "a key padding mask"
        return "structured", f"far-constant bias, {masked}, {why}: fused bias-free far parts plus a tiled band"
    return "blockwise", f"tiled, memory O(N·D) (structured path not taken: {why})"


def explain_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    query_start: int | None = None,
    key_start: int = 0,
    backend: str = "auto",
) -> tuple[str, str]:
    """Which backend :func:`relbias.attention` would run for these arguments, and why; runs nothing.

    Args:
        query, key, value, bias, mask, is_causal, query_start, key_start: as :func:`relbias.attention`.
        backend: "auto" (default) or a backend name.

    Returns:
        (name, reason): the backend and a sentence saying why (for a named backend: why it can run).

    Raises:
        ValueError: unknown backend, a named backend that cannot run this call (the message says why),
            or invalid inputs as :func:`relbias.attention`.
        TypeError: invalid input types, as :func:`relbias.attention`.

    Example:
        >>> import torch, relbias
        >>> q = torch.randn(1, 8, 4096, 64)
        >>> relbias.explain_backend(q, q, q, bias=relbias.T5Bias(8))[0]
        'structured'
    """
    alignment = _checks.check_call(
        query, key, value, bias=bias, mask=mask, is_causal=is_causal, query_start=query_start, key_start=key_start
    )
    return resolve_backend(backend, query, key, value, bias=bias, mask=mask, is_causal=is_causal, alignment=alignment)


def resolve_backend(name, query, key, value, *, bias, mask, is_causal, alignment) -> tuple[str, str]:
    """``(name, reason)`` for "auto" or a named backend; raises ValueError when a named one cannot run."""
    from .backends import BACKENDS

    if name == "auto":
        return choose_backend(query, key, value, bias=bias, mask=mask, is_causal=is_causal, alignment=alignment)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {['auto', *sorted(BACKENDS)]}")
    ok, reason = check_backend(name, query, key, value, bias=bias, mask=mask, is_causal=is_causal, alignment=alignment)
    if not ok:
        raise ValueError(f"backend {name!r} cannot run this call: {reason}")
    return name, reason
