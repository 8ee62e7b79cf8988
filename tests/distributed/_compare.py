"""Comparing a sharded model's results with one process's, for the model-level multi-process cases (not a test
module): how far each value is beyond float32 rounding (tests/_tolerance.py), and every parameter's gradient at
the scale of its module's gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _tolerance  # noqa: E402  (tests/_tolerance.py)


def seq2seq_step(model, ids, mask, decoder_ids, decoder_mask, labels):
    """One training step's forward and backward of a transformers seq2seq model, without a cache: the summed
    cross-entropy of the logits against ``labels`` (summed, so that the ranks' losses add up to one process's).
    Returns the model's output."""
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                use_cache=False)
    F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return out


def excess(got, want, n: int, scale=None) -> float:
    """How far ``got`` is beyond the rounding of ``n``-term sums around ``want`` (0.0 within it; inf when one of
    them is None and the other not)."""
    if got is None or want is None:
        return float("inf") if (got is None) != (want is None) else 0.0
    atol, rtol = _tolerance.rounding_tolerance(want, n=n, scale=scale)
    return max(((got - want).abs() - (atol + rtol * want.abs())).max().item(), 0.0)


def grad_errors(model, ref, n: int, whole) -> dict[str, float]:
    """``{"d:" + name: excess}`` of every parameter's gradient against the reference's, ``whole(name, grad)`` being
    the gradient one process would have (summed over ranks, gathered from shards, or as it is). Each is compared at
    the scale of its module's gradients (a Linear's weight and bias together: a bias's gradient can cancel to
    rounding noise that its own scale would not bound)."""
    scales: dict = {}
    for name, rp in ref.named_parameters():
        if rp.grad is not None:
            owner = name.rpartition(".")[0]
            scales[owner] = max(scales.get(owner, 0.0), rp.grad.abs().max().item())
    errors = {}
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        grad = None if p.grad is None else whole(name, p.grad)
        errors["d:" + name] = excess(grad, rp.grad, n, scale=scales.get(name.rpartition(".")[0]))
    return errors
