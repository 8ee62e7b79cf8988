"""First-order backward passes: a clear error for double backward instead of a silently missing term.

The fused and tiled backends compute their gradients in closed form, once; their gradients are not
themselves differentiable. ``torch.autograd.function.once_differentiable`` raises only when the incoming
output gradients require grad, so ``torch.autograd.grad(out.sum(), q, create_graph=True)`` would return a
gradient without a graph and a gradient penalty would silently lose its term. :func:`first_order` refuses
any backward run with ``create_graph=True`` (grad mode is on exactly then) and runs the others without
recording a graph.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["first_order"]


def first_order(backend: str):
    """Decorator for the ``backward`` staticmethod of ``backend``'s autograd Function (place it under
    ``@staticmethod``).

    Raises (from the decorated backward):
        RuntimeError: the backward runs with ``create_graph=True`` (double backward, e.g. a gradient penalty).
    """

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"backend {backend!r} has no double backward (its gradients are computed once, in closed form); "
                    f"for create_graph=True pass backend='reference', which differentiates plain operations"
                )
            return backward(ctx, *grad_outputs)

        return wrapper

    return decorate
