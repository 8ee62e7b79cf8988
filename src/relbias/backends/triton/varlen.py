"""Packed sequences in one launch of the Triton kernels (:func:`relbias.attention_varlen` on CUDA).

The kernels' sequence axis runs over the packed sequences: a program's tiles hold rows of one sequence only (no tile
crosses a boundary, no padding is added), positions restart at 0 at each sequence start, and the bias is read from the
native form of the longest sequence, whose per-offset values hold every offset a shorter one needs. A window applies
per sequence: positions restart at 0, so one band of offsets serves every sequence. Each sequence keeps its own
dropout seed, drawn in order as the per-sequence path draws it, so both drop the same entries.
"""

from __future__ import annotations

import torch

from ...biases.base import RelativeBias
from ...call import _all_finite, _dropout, make_call

__all__ = ["packed_attention"]


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], *,
                     bias: RelativeBias | None, is_causal: bool, scale: float | None, convention: str | None,
                     backend: str, return_lse: bool, dropout_p: float, generator: torch.Generator | None,
                     window: tuple[int | None, int | None] | None = None):
    """:func:`relbias.attention_varlen`'s result by one launch, or None when ``backend`` is "auto" and the triton
    backend cannot run these sequences (the caller then runs them one by one). Arguments as
    :func:`relbias.attention_varlen`'s, ``bounds`` checked.

    Raises:
        ValueError: ``backend`` is "triton" and cannot run them (the message says why); the errors of
            :func:`relbias.attention` for the longest sequence.
    """
    from .. import BACKENDS
    from . import make_plan
    from ._function import triton_apply

    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    if longest is None or lengths[longest] == 0:
        return None
    rows = slice(bounds[longest], bounds[longest + 1])
    throwaway = torch.Generator() if dropout_p else None  # the call's seed goes unused: each sequence draws its own
    call = make_call(query[:, :, rows], key[:, :, rows], value[:, :, rows], bias=bias, is_causal=is_causal,
                     scale=scale, convention=convention, return_lse=return_lse, dropout_p=dropout_p,
                     generator=throwaway, window=window)
    triton_backend = BACKENDS["triton"]
    reasons = (triton_backend.auto_reasons(call) if backend == "auto" else []) or \
        triton_backend.unsupported_reasons(call)
    hides_keys = is_causal or call.window is not None  # some key of a sequence hidden from some of its queries
    reads = hides_keys and not reasons and not torch.compiler.is_compiling()  # a compiled graph reads no value
    if reads and not (_all_finite(key) and _all_finite(value)):
        reasons = ["a key or value holds NaN/inf, which the kernels would spread to queries of its sequence that "
                   "cannot see it"]
    if reasons:
        if backend == "triton":
            raise ValueError(f"backend 'triton' cannot run these packed sequences: {'; '.join(reasons)}")
        return None
    seeds = None
    if call.dropout is not None:
        seeds = [_dropout(dropout_p, generator, query.device).seed if n else 0 for n in lengths]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    plan = make_plan(call, None, cu_seqlens=cu_seqlens, seeds=seeds, max_len=lengths[longest])
    out, lse = triton_apply(query, key, value, call.native_bias().values, None, plan)
    return (out, lse) if return_lse else out
