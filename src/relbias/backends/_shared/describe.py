"""What one attention call asks for, in words: the start of the first line :func:`relbias.explain_backend` gives
(the backend's own words on how it runs the call follow it)."""

from __future__ import annotations

import torch

from ...biases.base import RelativeBias
from ...call import AttentionCall

__all__ = ["describe_call"]


def _bias(call: AttentionCall) -> str:
    if call.bias is None:
        return "no bias"
    if isinstance(call.bias, torch.Tensor):
        return "a materialised bias tensor"
    kind = "offset-only " if isinstance(call.bias, RelativeBias) and call.bias.offset_only else ""
    return f"{kind}{type(call.bias).__name__}"


def _mask(call: AttentionCall) -> str:
    mask = call.mask
    if mask is None:
        return "no mask"
    if mask.dtype == torch.bool:
        return "a bool key padding mask" if mask.shape[-2] == 1 else "a bool mask"
    return f"a {str(mask.dtype).removeprefix('torch.')} additive mask"


def describe_call(call: AttentionCall) -> str:
    """``call`` in a phrase: direction, bias, mask, dropout, whether a backward will run, and the dtype, e.g.
    "causal, offset-only T5Bias, no mask, no dropout, forward only (inference), float32"."""
    dropout = "no dropout" if call.dropout is None else f"dropout_p={call.dropout.p}"
    passes = "forward and backward" if call.needs_grad else "forward only (inference)"
    dtype = str(call.query.dtype).removeprefix("torch.")
    direction = "causal" if call.is_causal else "bidirectional"
    return ", ".join((direction, _bias(call), _mask(call), dropout, passes, dtype))
