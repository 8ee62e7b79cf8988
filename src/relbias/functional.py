"""``relbias.attention``: scaled dot-product attention with a relative position bias."""

from __future__ import annotations

import torch

from . import _repeat
from .backends import registry
from .biases.base import RelativeBias
from .call import make_call
from .dispatch import pick_backend

__all__ = ["attention", "attention_with_weights"]


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    convention: str | None = None,
    query_start: int | torch.Tensor | None = None,
    key_start: int | torch.Tensor = 0,
    backend: str = "auto",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention with a relative position bias: ``out_i = sum_j alpha(i, j) v_j``.

    ``alpha(i, j) = softmax_j(score(i, j))`` with, by score convention (docs/conventions.md):

    * ``"seed"``: ``score = ((q_i . k_j) + PE(i, j)) * scale + Mask(i, j)`` (the bias is scaled too);
    * ``"additive"``: ``score = (q_i . k_j) * scale + PE(i, j) + Mask(i, j)`` (PyTorch SDPA, ALiBi);
    * ``"t5"``: ``score = (q_i . k_j) + PE(i, j) + Mask(i, j)``, no scaling (Raffel et al. 2020, §2.1).

    Shape legend: B batch, H num_heads, Lq query_len, Lk key_len, D head_dim, Dv value head_dim.

    Positions: the first key sits at ``key_start`` (default 0) and the first query at ``query_start``
    (default ``key_start + Lk - Lq``: queries aligned to the last keys, as with a KV cache). The bias
    reads offsets ``i - j`` of these absolute positions, and the causal mask hides keys with ``j > i``::

        Lq = 2, Lk = 5, default alignment (queries at 3, 4), is_causal=True:
            keys  0 1 2 3 4
            q@3   x x x x .
            q@4   x x x x x

    Args:
        query: (B, H, Lq, D), float16/bfloat16/float32/float64.
        key: (B, H, Lk, D), same dtype and device as ``query``; (B, Hkv, Lk, D) with ``enable_gqa``.
        value: (B, H, Lk, Dv), same dtype and device; (B, Hkv, Lk, Dv) with ``enable_gqa``.
        bias: ``None``; a :class:`relbias.RelativeBias` module (T5Bias, PerOffsetBias, FunctionBias ...),
            evaluated at the block's offsets; or a float tensor broadcastable to (B, H, Lq, Lk), logits.
        mask: ``None``; bool broadcastable to (B, H, Lq, Lk), True = may attend; or float, additive,
            with -inf for masked keys, in any floating dtype: it is added in the computation's dtype (float32 for
            float32, bfloat16 and float16 inputs, float64 for float64), so a float64 or float16 mask with float32
            inputs is cast to float32 (SDPA's ``attn_mask`` raises there; pass ``mask.to(query.dtype)`` to match
            it). A masked key gets exactly zero weight whatever its score.
        is_causal: hide future keys (offset < 0) under the alignment above.
        scale: multiplier of the scores; default ``1 / sqrt(D)`` for "seed" and "additive"; an explicit
            value (e.g. 1.0) is honoured. Must be 1 or None for "t5".
        convention: "seed", "additive" or "t5"; default the bias module's own (T5Bias: "t5",
            PerOffsetBias / FunctionBias: "seed"); "additive" for a tensor bias, so that ``bias=T`` means what
            SDPA's ``attn_mask=T`` means; "seed" for no bias (the conventions then agree).
        query_start: absolute position (tokens) of the first query: an int, or a 0-dim integer tensor (a static KV
            cache's token count). Eager calls read a tensor once (``int``); under ``torch.compile`` it stays a
            tensor, so one graph serves every position: then the int64 range check of positions is skipped,
            ``is_causal`` is applied as an explicit (1, 1, Lq, Lk) mask, and the reference and decode backends run
            the call (blockwise and structured need int positions).
        key_start: absolute position (tokens) of the first key, the same.
        backend: "auto" (default): the small-block rule, then the first backend in
            ``relbias.backends.BACKENDS`` (priority order) that can run the call
            (:func:`relbias.explain_backend` says which and why); or a name, each described here by its
            ``summary`` (what ``explain_backend`` says; a backend that cannot run a call names its reasons):

            * "decode": few queries (at most 16): the bias rows read by one fused kernel call (relbias' native
              toeplitz forward, or CPU flash attention with the rows as its mask), as fast as bias-free attention;
              inference
            * "triton": offset-only bias read from its per-offset values, no mask or a bool key padding mask,
              dropout and packed sequences inside the kernels: fused Triton FlashAttention-2 forward and backward
              with a deterministic bias gradient (CUDA; CPU tensors only under the Triton interpreter); memory
              O(N·D)
            * "flex": FlexAttention (torch.compile, per length bucket) with the bias looked up per score; memory
              O(N·D)
            * "toeplitz": offset-only bias read from its per-offset values, no mask or a bool key padding mask,
              dropout inside the native kernels: fused C++ FlashAttention-2 forward and backward (built on first
              use; else PyTorch's CPU flash kernel with the bias as a strided view); memory O(N·D)
            * "structured": far-constant bias: fused bias-free far parts (CPU flash kernel) plus a tiled band,
              merged by log-sum-exp; memory O(N·D)
            * "blockwise": tiled attention in PyTorch (online softmax, recomputing backward): any device, dtype,
              bias module and mask; memory O(N·D)
            * "reference": the reference materialises the (B, H, Lq, Lk) scores: runs every call, memory
              O(B·H·Lq·Lk)
        return_lse: also return the log-sum-exp of each query's scores (default False).
        dropout_p: probability of dropping each attention probability (default 0.0: no dropout, and the call
            is exactly the undropped one), as SDPA's ``dropout_p``; kept probabilities are scaled by
            ``1 / (1 - dropout_p)``. The mask is counter-based, a hash of (seed, batch, head, query position,
            key position), so a backward pass regenerates it and every tiling drops the same entries; the
            reference, blockwise, toeplitz (inside its native kernels, where they run) and triton backends apply it,
            decode, structured and flex refuse it. Applied whatever the module's training mode: pass 0 for
            evaluation.
        generator: the torch.Generator from which the call's mask seed is drawn (default: torch's global RNG,
            so ``torch.manual_seed`` reproduces the mask). Under ``torch.compile`` the seed is drawn from the global
            generator in the graph (on the query's device), so dropout ends no graph; with the compiler's own random
            numbers (inductor's) the masks differ from eager's. A generator object is not traced: it ends the graph
            where the seed is drawn (``fullgraph=True`` refuses it).
        attn_mask: SDPA's name for ``mask``, with the same meaning as in
            ``torch.nn.functional.scaled_dot_product_attention`` and here: bool True = may attend, float
            additive. (``torch.nn.MultiheadAttention``'s bool ``attn_mask``, and so
            :class:`relbias.nn.MultiheadAttention`'s, has the opposite polarity: True = NOT allowed.) Pass
            ``mask`` or ``attn_mask``, not both.
        enable_gqa: grouped-query attention (Ainslie et al. 2023), as SDPA's ``enable_gqa``: key and value have
            Hkv heads, H a multiple of Hkv, and query head ``h`` reads key/value head ``h // (H // Hkv)``. Default
            False (equal head counts). Key and value are repeated to H heads before the backend runs (a copy of
            O(B·H·Lk·D) per call, as SDPA's math path does); the bias and the mask have H (or 1) heads.
        window: local (sliding-window) attention: None (default: every key), or ``(left, right)``, ints >= 0
            (tokens) or None (unbounded on that side): the query at position ``i`` sees the keys ``j`` with
            ``i - left <= j <= i + right``, offsets ``-right <= i - j <= left`` (:mod:`relbias.window`;
            FlashAttention's ``window_size``, with None for its -1). With ``is_causal=True``, ``(W - 1, 0)`` is a
            causal window of W keys. Composes with masks, positions, dropout, GQA and ``return_lse``; offsets
            outside the window are never evaluated by the bias. The fused backends skip every tile outside the
            band: time and memory O(Lq·W).

    Returns:
        out (B, H, Lq, Dv) in the dtype of ``query``; with ``return_lse=True`` the pair ``(out, lse)``,
        lse (B, H, Lq) float32 (float64 for float64 inputs): the natural log-sum-exp of each query's scores
        over its visible keys (scale, bias and additive mask included), ``-inf`` for a query with no
        visible key; both differentiable. Two calls over disjoint key sets merge exactly:
        ``m = logaddexp(lse_1, lse_2)``, ``out = out_1 * exp(lse_1 - m) + out_2 * exp(lse_2 - m)``. Softmax and its accumulations run in float32 (float64
        for float64 inputs). A query with no visible key returns zeros, with finite (zero) gradients.
        Keys that no query can see (padding) contribute nothing even if their key or value holds
        NaN/inf; NaN/inf in a query, or in a key or value that a query can see, propagate to that
        query's output only (gradients are then undefined).

    Raises:
        TypeError: a non-tensor or non-float query/key/value, mismatched dtypes, an integer mask,
            a non-float bias tensor, non-int positions, a non-bool ``return_lse``, a ``generator`` that is not a
            torch.Generator, both ``mask`` and ``attn_mask``, a non-bool ``enable_gqa``, a ``window`` that is not a
            pair of ints or None.
        ValueError: wrong ranks; batch, heads, head_dim or key/value lengths that differ; a bias or
            mask that does not broadcast to (B, H, Lq, Lk); a bias module whose num_heads is neither 1
            nor H; a non-finite bias tensor; a float mask with NaN or +inf, or of only 0s and 1s (a 0/1 keep mask
            is passed as ``mask.bool()``); a non-positive scale, or a
            scale other than 1 with "t5"; with ``enable_gqa``, key and value head counts that differ or do not
            divide the query's; an unknown convention or backend; ``dropout_p`` outside [0, 1);  a named backend that cannot
            run the call (the message says why); arguments on different
            devices; a causal-only bias (``bidirectional=False``) asked about a visible future key;
            offsets a bias cannot evaluate (e.g. beyond a per-offset table with clipping off); a negative window
            side.

    Example:
        >>> import torch, relbias
        >>> q = k = v = torch.randn(1, 8, 16, 64)
        >>> out = relbias.attention(q, k, v, bias=relbias.T5Bias(num_heads=8))  # T5's unscaled scores
        >>> out.shape
        torch.Size([1, 8, 16, 64])
    """
    # an inference call repeated with the same signature skips what validation and dispatch decided for it
    signature = _repeat.signature(query, key, value, bias, mask, is_causal, scale, convention, query_start, key_start,
                                  backend, return_lse, dropout_p, generator, attn_mask, enable_gqa, window)
    repeated = None if signature is None else _repeat.run(signature, query, key, value, bias, return_lse)
    if repeated is not None:
        out, lse = repeated
        return (out, lse) if return_lse else out
    generation = registry.generation()  # the registry the choice below is made against
    call = make_call(
        query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale, convention=convention,
        query_start=query_start, key_start=key_start, return_lse=return_lse, dropout_p=dropout_p, generator=generator,
        attn_mask=attn_mask, enable_gqa=enable_gqa, window=window,
    )
    chosen = pick_backend(backend, call)
    out, lse = chosen.forward(call)
    if signature is not None:  # after the forward, which derives values a repeat reuses
        _repeat.remember(signature, backend, chosen, call, generation)
    return (out, lse) if return_lse else out


def attention_with_weights(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` that also returns the attention probabilities, materialised.

    Runs the reference backend on ``value`` extended by an identity over the keys, so the weights are
    exactly the probabilities that produce the output (a masked key 0, a row with no visible key all 0).
    Memory O(B·H·Lq·Lk): for inspection, ``output_attentions`` and small blocks, not for long sequences.

    Args:
        query, key, value: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv) as :func:`attention`.
        **kwargs: the keyword arguments of :func:`attention` except ``backend`` and ``return_lse``.

    Returns:
        (out (B, H, Lq, Dv), weights (B, H, Lq, Lk)), both in the dtype of ``query``; differentiable.

    Raises:
        TypeError: ``backend`` or ``return_lse`` given; otherwise as :func:`attention`.
    """
    for name in ("backend", "return_lse"):
        if name in kwargs:
            raise TypeError(f"attention_with_weights runs the reference backend and returns no lse; got {name}=")
    key_len = key.shape[-2] if isinstance(key, torch.Tensor) and key.dim() == 4 else 0
    if isinstance(value, torch.Tensor) and value.dim() == 4:
        eye = torch.eye(key_len, dtype=value.dtype, device=value.device).expand(*value.shape[:2], key_len, key_len)
        value = torch.cat([value, eye], dim=-1)  # (B, H, Lk, Dv + Lk): the identity columns carry the weights
    both = attention(query, key, value, backend="reference", **kwargs)
    split = both.shape[-1] - key_len
    return both[..., :split], both[..., split:]
