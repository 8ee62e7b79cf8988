"""``relbias.attention_varlen``: attention over packed variable-length sequences.

Several sequences concatenated along the length (no padding), with their boundaries ``cu_seqlens`` (cumulative
lengths, as FlashAttention's ``flash_attn_varlen_func`` and Hugging Face's ``DataCollatorWithFlattening`` give
them): each query attends only to keys of its own sequence, and positions restart at 0 at each sequence start, so
every bias sees the offsets its sequence alone would have. On CUDA (or with ``backend="triton"``), the triton backend
runs every sequence in one launch of its kernels where it can (:mod:`relbias.backends.triton.varlen`); otherwise each
sequence runs as its own :func:`relbias.attention` call through the backend contract. Either way no tile crosses a
boundary, and the result and its gradients equal running the sequences one by one.
"""

from __future__ import annotations

import torch

from .biases.base import RelativeBias
from .functional import attention

__all__ = ["attention_varlen"]


def attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    *,
    bias: RelativeBias | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    convention: str | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Self-attention over sequences packed along the length, each attending only to itself.

    Sequence n holds the packed positions ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1``; within it, query t and key
    s sit at positions t and s (tokens from the sequence's start), so the bias reads the offset ``t - s`` and a
    causal mask hides ``s > t``, exactly as :func:`relbias.attention` on that sequence alone. Shape legend: H
    num_heads, T total tokens (the sum of the lengths), D head_dim, Dv value head_dim, N sequences.

    Args:
        query: (1, H, T, D), float16/bfloat16/float32/float64: the packed queries (batch 1: every sequence is
            in the length dimension).
        key: (1, H, T, D), same dtype and device; value: (1, H, T, Dv).
        cu_seqlens: the N + 1 boundaries, int (a list or a 1-D integer tensor, read on the host: O(N)), starting
            at 0, non-decreasing, ending at T. Empty sequences (equal neighbours) are allowed.
        bias: None or a :class:`relbias.RelativeBias` module (a bias tensor has no packed form).
        is_causal, scale, convention, return_lse, window: as :func:`relbias.attention`, per sequence (a window
            never reaches into another sequence).
        backend: as :func:`relbias.attention`; "auto" on CUDA and "triton" run the sequences in one launch of the
            triton backend (``"auto"`` runs them one by one where it cannot), any other name one call per sequence.
        dropout_p, generator: attention dropout as :func:`relbias.attention`; each sequence draws its own mask
            seed from ``generator`` (or torch's global RNG), in order, so a seeded generator repeats the result.

    Returns:
        out (1, H, T, Dv) in the dtype of ``query``; with ``return_lse``, also lse (1, H, T) float32 (float64 for
        float64 inputs). Differentiable in query, key, value and the bias parameters. Source: FlashAttention's
        variable-length interface (Dao 2023, ``flash_attn_varlen_func``).

    Raises:
        TypeError: a non-integer ``cu_seqlens``; a bias that is not a RelativeBias module or None.
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, decreasing, or not ending at T (the message gives
            the first offending entry); query, key and value not (1, H, T, ·) with one T; the errors of
            :func:`relbias.attention` for any sequence.

    Example:
        >>> import torch, relbias
        >>> lengths = [5, 3, 8]                                  # three sequences, packed: 16 tokens
        >>> q = k = v = torch.randn(1, 2, sum(lengths), 4)       # (1, H, T, D)
        >>> bias = relbias.T5Bias(num_heads=2, bidirectional=False)
        >>> out = relbias.attention_varlen(q, k, v, [0, 5, 8, 16], bias=bias, is_causal=True)
        >>> alone = relbias.attention(q[:, :, 5:8], k[:, :, 5:8], v[:, :, 5:8], bias=bias, is_causal=True)
        >>> bool(torch.allclose(out[:, :, 5:8], alone))          # the second sequence, as if alone
        True
    """
    bounds = _boundaries(cu_seqlens, query, key, value)
    if bias is not None and not isinstance(bias, RelativeBias):
        raise TypeError(f"attention_varlen takes a RelativeBias module or None as bias, got {type(bias).__name__}")
    if backend == "triton" or (backend == "auto" and query.device.type == "cuda"):
        from .backends.triton.varlen import packed_attention

        packed = packed_attention(query, key, value, bounds, bias=bias, is_causal=is_causal, scale=scale,
                                  convention=convention, backend=backend, return_lse=return_lse, dropout_p=dropout_p,
                                  generator=generator, window=window)
        if packed is not None:
            return packed
    outs, lses = [], []
    kwargs = dict(bias=bias, is_causal=is_causal, scale=scale, convention=convention, backend=backend,
                  dropout_p=dropout_p, generator=generator, return_lse=return_lse, window=window)
    # One split per tensor (its backward concatenates the pieces' gradients once; a slice per sequence would add a
    # zero-filled (1, H, T, D) gradient per sequence)
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2)):
        if q.shape[2] == 0:
            continue
        got = attention(q, k, v, **kwargs)
        outs.append(got[0] if return_lse else got)
        if return_lse:
            lses.append(got[1])
    h, dv = query.shape[1], value.shape[-1]
    out = torch.cat(outs, dim=2) if outs else query.new_zeros(1, h, 0, dv)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=2) if lses else query.new_zeros(
        1, h, 0, dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    return out, lse


def _boundaries(cu_seqlens, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as a list of ints, checked against the packed (1, H, T, ·) tensors."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or tensor.shape[0] != 1:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"attention_varlen takes packed (1, H, T, D) tensors; {name} is {shape}")
    total = query.shape[2]
    if key.shape[2] != total or value.shape[2] != total:
        raise ValueError(f"query, key and value must hold the same T packed tokens, got {query.shape[2]}, "
                         f"{key.shape[2]} and {value.shape[2]}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D (N + 1 boundaries), got shape {tuple(cu_seqlens.shape)}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
    else:
        bounds = list(cu_seqlens)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            raise TypeError(f"cu_seqlens must hold integers, got {bounds!r}")
    if len(bounds) < 1 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[:3]!r}")
    for n in range(1, len(bounds)):
        if bounds[n] < bounds[n - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing: entry {n} is {bounds[n]} after {bounds[n - 1]}")
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens must end at the packed length T = {total}, got {bounds[-1]}")
    return bounds
