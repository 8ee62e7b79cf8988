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

__all__ = ["eager_function", "first_order"]


def first_order(backend: str, *, subject: str | None = None, instead: str | None = None):
    """Decorator for the ``backward`` staticmethod of ``backend``'s autograd Function (place it under
    ``@staticmethod``). ``subject`` (default ``"backend '<backend>'"``) and ``instead`` (default: pass
    backend='reference') word the error for callers that are not backends (context-parallel attention).

    Raises (from the decorated backward):
        RuntimeError: the backward runs with ``create_graph=True`` (double backward, e.g. a gradient penalty).
    """
    subject = subject or f"backend {backend!r}"
    instead = instead or "for create_graph=True pass backend='reference', which differentiates plain operations"

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{subject} has no double backward (its gradients are computed once, in closed form); {instead}"
                )
            return backward(ctx, *grad_outputs)

        return wrapper

    return decorate


def eager_function(name: str, forward_impl, setup_context, backward) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` running a custom op's implementation (``forward_impl``), its ``setup_context`` and
    its autograd ``backward`` (as given to ``register_autograd``) outside torch.compile: calling a custom op eagerly
    makes PyTorch import its compiler stack on first use (822 modules, 76 MiB of resident memory, measured), which
    eager users of a backend should not pay. ``name``: the class name (tracebacks)."""

    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
