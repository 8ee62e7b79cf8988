"""Perplexity and bits per byte of a byte-level LM at several evaluation lengths."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .model import ByteLM
from .train import Progress, no_progress

__all__ = ["evaluate_lengths", "check_reachable", "scored_bytes"]


def check_reachable(model: ByteLM, length: int) -> None:
    """Raise now, before any training, if the model's position bias cannot evaluate ``length`` tokens.

    Evaluates every bias module for the last query of a ``length``-token window against all its keys
    (offsets 0 .. length - 1), which is where a per-offset table with clipping off runs out.

    Raises:
        ValueError: the family's own error (e.g. "offset 127 has no parameter ... out_of_range='clip'"),
            prefixed with the scheme and the evaluation length.
    """
    for bias in model.position_biases:
        try:
            with torch.no_grad():
                bias(1, length, query_start=length - 1)
        except ValueError as exc:
            raise ValueError(
                f"scheme {model.config.position!r} cannot be evaluated at length {length} "
                f"(trained at {model.config.max_len}): {exc}"
            ) from exc


def scored_bytes(val_len: int, lengths: list[int]) -> int:
    """How many held-out bytes every evaluation length scores: the largest multiple of lcm(lengths) < val_len.

    Args:
        val_len: held-out bytes.
        lengths: evaluation lengths in tokens, each >= 1.

    Raises:
        ValueError: an empty or invalid ``lengths``; ``val_len < lcm(lengths) + 1``.
    """
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"evaluation lengths must be ints >= 1, got {lengths!r}")
    span = math.lcm(*lengths)  # every length's windows tile the same targets; +1 leading input byte
    usable = (val_len - 1) // span * span
    if usable == 0:
        raise ValueError(
            f"the held-out split has {val_len} bytes; scoring the same bytes at every evaluation length "
            f"{sorted(lengths)} needs at least lcm = {span} + 1 (the longest is {max(lengths)}); use a larger "
            f"corpus, a larger --val-fraction or shorter lengths"
        )
    return usable


@torch.no_grad()
def evaluate_lengths(
    model: ByteLM,
    val_tokens: torch.Tensor,
    lengths: list[int],
    *,
    batch_tokens: int = 8192,
    progress: Progress = no_progress,
) -> dict[int, dict[str, float]]:
    """Mean next-byte loss on non-overlapping windows of each length, over the same bytes for every length.

    The first ``U`` target bytes are scored, ``U`` the largest multiple of lcm(lengths) below the split's
    size (:func:`scored_bytes`). For each length n the inputs are cut into consecutive, non-overlapping
    windows of n bytes; every target byte is scored once, with the context before it inside its window
    (Press et al. 2022, ALiBi, §4: non-overlapping evaluation). Because all lengths score exactly the same target bytes,
    the numbers differ only by how much context (and how far beyond the training length) the model
    sees.

    Args:
        model: the model (run in eval mode, without gradients).
        val_tokens: uint8 (N,) held-out bytes, N >= lcm(lengths) + 1.
        lengths: evaluation lengths in tokens, each >= 1.
        batch_tokens: about this many tokens per forward pass (memory: the reference backend holds
            B x H x n x n float32 scores).
        progress: progress hook, e.g. ``tqdm.tqdm``.

    Returns:
        ``{n: {"nll": nats per byte, "bpb": bits per byte, "ppl": exp(nll), "tokens": scored bytes}}``.

    Raises:
        ValueError: an empty or invalid ``lengths``; fewer validation bytes than ``lcm(lengths) + 1``;
            errors of the model (see :func:`check_reachable`).
    """
    usable = scored_bytes(len(val_tokens), lengths)
    model.eval()
    results: dict[int, dict[str, float]] = {}
    for n in progress(lengths, desc="evaluate", total=len(lengths)):
        inputs = val_tokens[:usable].long().view(-1, n)  # (W, n) windows
        targets = val_tokens[1 : usable + 1].long().view(-1, n)
        per_batch = max(1, batch_tokens // n)
        total = 0.0
        for start in range(0, inputs.shape[0], per_batch):
            logits = model(inputs[start : start + per_batch])  # (b, n, 256)
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets[start : start + per_batch].reshape(-1), reduction="sum"
            ).item()
        nll = total / usable
        results[n] = {"nll": nll, "bpb": nll / math.log(2), "ppl": math.exp(nll), "tokens": usable}
    return results
