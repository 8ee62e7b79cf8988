"""Running a strategy's autograd Function, or its forward alone where nothing needs a gradient."""

from __future__ import annotations

import torch

from .validate import ContextParallelCall

__all__ = ["apply_strategy"]


def apply_strategy(function: type[torch.autograd.Function], forward, call: ContextParallelCall, query, key, value,
                   stats) -> torch.Tensor:
    """This rank's output shard (B, H, L/P, Dv) in the dtype of ``query``.

    With gradients enabled and any of query, key, value or the bias's trainable parameters requiring one:
    ``function.apply(query, key, value, call, stats, *params)``; otherwise ``forward(call, query, key, value,
    stats)[0]`` under ``torch.no_grad`` (no autograd Function, nothing saved for backward).
    """
    bias = call.settings.bias
    params = [] if bias is None else [p for p in bias.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and any(t.requires_grad for t in [query, key, value, *params]):
        return function.apply(query, key, value, call, stats, *params)
    with torch.no_grad():
        return forward(call, query, key, value, stats)[0].to(query.dtype)
