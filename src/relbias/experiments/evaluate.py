"""Perplexity and bits per byte of a byte-level LM at several evaluation lengths."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from ..window import check_window
from .model import ByteLM
from .train import Progress, no_progress

__all__ = ["EVAL_MODES", "MIN_WINDOWS", "WHOLE_TEXT_TOKENS", "evaluate_lengths", "evaluate_whole_text",
           "attention_window", "training_window", "check_reachable", "scored_bytes", "check_windows", "window_plan"]

#: Evaluation modes of Press et al. 2022 (ALiBi), §4 and Appendix B.
EVAL_MODES = ("nonoverlapping", "sliding")

#: Fewest non-overlapping windows of held-out text an evaluation length must fill: each length's score then
#: averages at least this many separate passages, not the reading of one or two.
MIN_WINDOWS = 8

#: Most scored bytes per forward of :func:`evaluate_whole_text`: the default corpus's 45,056 go in one.
WHOLE_TEXT_TOKENS = 1 << 16


def training_window(train_len: int) -> tuple[int, int]:
    """``(train_len - 1, 0)``: with the causal rule, each query sees itself and at most ``train_len - 1`` earlier
    keys, so every attention row spans the offsets 0 .. L - 1 that training at length L saw, whatever the length of
    the text (:mod:`relbias.window`)."""
    if isinstance(train_len, bool) or not isinstance(train_len, int) or train_len < 1:
        raise ValueError(f"train_len must be an int >= 1, got {train_len!r}")
    return (train_len - 1, 0)


@contextlib.contextmanager
def attention_window(model: ByteLM, window: tuple[int | None, int | None] | None) -> Iterator[None]:
    """Inside the block, every attention layer of ``model`` runs with ``window`` (its ``window`` attribute, as
    :class:`relbias.nn.MultiheadAttention` keeps it); the layers' own windows come back afterwards, also on error.

    Args:
        model: a :class:`ByteLM` (or a baseline of :mod:`relbias.experiments.positional`).
        window: ``(left, right)`` as :func:`relbias.attention` takes it, or None for no window.

    Raises:
        TypeError: an invalid ``window`` (:func:`relbias.window.check_window`); an attention layer without a
            ``window`` attribute.
    """
    window = check_window(window)
    layers = [block.attn for block in model.blocks]
    missing = sorted({type(layer).__name__ for layer in layers if not hasattr(layer, "window")})
    if missing:
        raise TypeError(f"attention layer(s) {missing} take no window (no 'window' attribute)")
    before = [layer.window for layer in layers]
    try:
        for layer in layers:
            layer.window = window
        yield
    finally:
        for layer, old in zip(layers, before):
            layer.window = old


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


def check_windows(usable: int, lengths: list[int], train_len: int, min_windows: int = MIN_WINDOWS) -> None:
    """Refuse an evaluation length that the scored held-out bytes fill with fewer than ``min_windows`` windows.

    Args:
        usable: scored held-out bytes (:func:`scored_bytes`).
        lengths: evaluation lengths in tokens.
        train_len: training length L, to name a length as a multiple of L.
        min_windows: fewest windows per length, an int >= 1. Default :data:`MIN_WINDOWS` (8).

    Raises:
        ValueError: naming the shortest such length, the windows it gets and the windows needed.
    """
    if isinstance(min_windows, bool) or not isinstance(min_windows, int) or min_windows < 1:
        raise ValueError(f"min_windows must be an int >= 1, got {min_windows!r}")
    for n in sorted(lengths):
        if usable // n < min_windows:
            raise ValueError(
                f"evaluation length {n} ({n / train_len:g}L): the held-out text gives {usable // n} window(s) of "
                f"{n} bytes ({usable} scored bytes), at least {min_windows} are needed; give it more held-out bytes "
                f"(a larger corpus, --val-fraction or --max-eval-bytes) or use lengths up to {usable // min_windows} bytes"
            )


def window_plan(usable: int, length: int, mode: str = "nonoverlapping", stride: int | None = None) -> list[tuple[int, int]]:
    """The windows that score target bytes 0 .. ``usable`` - 1, each exactly once (Press et al. 2022, §4).

    * "nonoverlapping": windows start at 0, n, 2n, ...; each scores all its n bytes, with 0 .. n - 1 bytes of
      context inside the window.
    * "sliding": the first window scores all its n bytes; each next one ends ``stride`` bytes later and scores
      only the bytes not scored yet (its last ``stride``, the last window fewer), each with at least
      n - ``stride`` bytes of context. ``stride = n`` is the non-overlapping plan.

    Window w covers input bytes ``start .. start + n - 1`` and scores its positions ``first .. n - 1``, i.e.
    target bytes ``start + first .. start + n - 1``.

    Args:
        usable: target bytes to score, a multiple of ``length`` for "nonoverlapping", >= ``length``.
        length: window length n in tokens.
        mode: one of :data:`EVAL_MODES`. Default "nonoverlapping".
        stride: S for "sliding", 1 <= S <= n; ignored otherwise.

    Returns:
        ``[(start, first), ...]`` in order.

    Raises:
        ValueError: an unknown mode; ``stride`` missing or outside [1, n] for "sliding"; ``usable`` < n.
    """
    if mode not in EVAL_MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}; expected one of {EVAL_MODES}")
    if usable < length:
        raise ValueError(f"need at least one window: {usable} bytes to score, windows of {length}")
    if mode == "nonoverlapping":
        return [(start, 0) for start in range(0, usable - length + 1, length)]
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= length:
        raise ValueError(f"sliding evaluation needs a stride in [1, {length}] (the window length), got {stride!r}")
    plan, end = [(0, 0)], length
    while end < usable:
        new_end = min(end + stride, usable)
        plan.append((new_end - length, length - (new_end - end)))
        end = new_end
    return plan


@torch.no_grad()
def evaluate_lengths(
    model: ByteLM,
    val_tokens: torch.Tensor,
    lengths: list[int],
    *,
    batch_tokens: int = 8192,
    mode: str = "nonoverlapping",
    stride: int | None = None,
    window: tuple[int | None, int | None] | None = None,
    progress: Progress = no_progress,
) -> dict[int, dict[str, float]]:
    """Mean next-byte loss on windows of each length, over the same bytes for every length.

    The first ``U`` target bytes are scored, ``U`` the largest multiple of lcm(lengths) below the split's
    size (:func:`scored_bytes`). For each length n the windows of :func:`window_plan` score every target byte
    once, with the context before it inside its window (Press et al. 2022, ALiBi, §4): consecutive non-overlapping
    windows of n bytes (``mode="nonoverlapping"``, the default), or windows of n bytes ``stride`` apart, each
    scoring only its new bytes (``mode="sliding"``). Because all lengths score exactly the same target bytes,
    the numbers differ only by how much context (and how far beyond the training length) the model
    sees.

    Args:
        model: the model (run in eval mode, without gradients).
        val_tokens: uint8 (N,) held-out bytes, N >= lcm(lengths) + 1.
        lengths: evaluation lengths in tokens, each >= 1.
        batch_tokens: about this many tokens per forward pass (memory: the reference backend holds
            B x H x n x n float32 scores).
        mode: "nonoverlapping" (default) or "sliding" (:data:`EVAL_MODES`).
        stride: with "sliding", S in [1, min(lengths)] tokens; sliding costs about n / S times as much as
            non-overlapping at length n.
        window: None (default: full causal attention inside each window), or ``(left, right)`` for every
            attention layer (:func:`attention_window`): ``training_window(L)`` = (L - 1, 0) lets each byte's
            query see itself and at most L - 1 earlier bytes of its window, as in training, at every length. The
            windows of bytes are the same either way; a fused backend skips the keys outside the attention window,
            so a length n costs O(n·L) instead of O(n²).
        progress: progress hook, e.g. ``tqdm.tqdm``.

    Returns:
        ``{n: {"nll": nats per byte, "bpb": bits per byte, "ppl": exp(nll), "tokens": scored bytes,
        "windows": forward windows}}``.

    Raises:
        ValueError: an empty or invalid ``lengths``; fewer validation bytes than ``lcm(lengths) + 1``; an
            unknown mode or a stride outside [1, n] (:func:`window_plan`);
            errors of the model (see :func:`check_reachable`).
        TypeError: an invalid ``window`` (:func:`attention_window`).
    """
    usable = scored_bytes(len(val_tokens), lengths)
    plans = {n: window_plan(usable, n, mode, stride) for n in lengths}  # every mode and stride error before work
    with attention_window(model, window):
        return _evaluate_plans(model, val_tokens, lengths, plans, usable, batch_tokens, progress)


def _evaluate_plans(model, val_tokens, lengths, plans, usable, batch_tokens, progress) -> dict[int, dict[str, float]]:
    model.eval()
    tokens = val_tokens[: usable + 1].long()
    results: dict[int, dict[str, float]] = {}
    for n in progress(lengths, desc="evaluate", total=len(lengths)):
        starts = torch.tensor([start for start, _ in plans[n]])  # (W,)
        first = torch.tensor([f for _, f in plans[n]])  # (W,)
        index = starts[:, None] + torch.arange(n)  # (W, n) input positions
        scored = torch.arange(n)[None, :] >= first[:, None]  # (W, n) the positions each window scores
        per_batch = max(1, batch_tokens // n)
        total = 0.0
        for b in range(0, index.shape[0], per_batch):
            rows = index[b : b + per_batch]
            logits = model(tokens[rows])  # (b, n, 256)
            losses = F.cross_entropy(logits.transpose(1, 2), tokens[rows + 1], reduction="none")  # (b, n)
            total += losses[scored[b : b + per_batch]].sum().item()
        nll = total / usable
        results[n] = {"nll": nll, "bpb": nll / math.log(2), "ppl": math.exp(nll), "tokens": usable,
                      "windows": len(plans[n])}
    return results


@torch.no_grad()
def evaluate_whole_text(
    model: ByteLM,
    val_tokens: torch.Tensor,
    lengths: list[int],
    window: tuple[int, int],
    *,
    max_tokens: int = WHOLE_TEXT_TOKENS,
    progress: Progress = no_progress,
) -> dict[str, float]:
    """Mean next-byte loss of the scored held-out bytes read in one forward, every attention layer windowed.

    Scores the same ``U`` target bytes as :func:`evaluate_lengths` (:func:`scored_bytes` of ``lengths``) from
    one sequence of the ``U`` input bytes before them, with ``window = (left, 0)`` on every layer. With
    ``training_window(L)`` each query sees itself and the L - 1 bytes before it (fewer only among the first
    L - 1 bytes of the text), so every byte from the L-th on is scored with a full attention window of L bytes
    at every layer: sliding evaluation with stride 1, at the cost of one pass. Through the layers a prediction
    can still draw on up to ``num_layers · left`` earlier bytes, as in any stack of windowed layers.

    A text longer than ``max_tokens`` is read in consecutive pieces of at most ``max_tokens`` scored bytes,
    each preceded by the ``num_layers · left`` bytes its predictions can reach (all of them from the text), so
    that a scheme that reads only offsets scores every byte as in one forward; positions restart at each piece,
    which changes the numbers of the schemes that read absolute positions (FIRE's normaliser, the sinusoidal
    baseline).

    Args:
        model: the model (run in eval mode, without gradients).
        val_tokens: uint8 (N,) held-out bytes, N >= lcm(lengths) + 1.
        lengths: the evaluation lengths, which fix the scored bytes.
        window: ``(left, 0)``, ``left`` an int >= 0 (the causal rule bounds the right side).
        max_tokens: most scored bytes per forward, an int >= 1. Default :data:`WHOLE_TEXT_TOKENS` (65,536).
        progress: progress hook, e.g. ``tqdm.tqdm``.

    Returns:
        ``{"nll", "bpb", "ppl", "tokens": scored bytes, "windows": forwards}``.

    Raises:
        ValueError: an invalid ``lengths`` or too little held-out text (:func:`scored_bytes`); a window with
            an unbounded left side or a right side other than 0; ``max_tokens`` < 1.
        TypeError: an invalid ``window`` (:func:`attention_window`).
    """
    usable = scored_bytes(len(val_tokens), lengths)
    checked = check_window(window)
    if checked is None or checked[0] is None or checked[1] not in (0, None):
        raise ValueError(f"whole-text evaluation needs a causal window (left, 0) with left an int >= 0, got {window!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    reach = len(model.blocks) * checked[0]  # bytes before a query that its output can depend on
    tokens = val_tokens[: usable + 1].long()
    model.eval()
    pieces = list(range(0, usable, max_tokens))
    total = 0.0
    with attention_window(model, (checked[0], 0)):
        for begin in progress(pieces, desc="whole text", total=len(pieces)):
            end = min(begin + max_tokens, usable)
            context = min(begin, reach)
            logits = model(tokens[None, begin - context : end])[:, context:]  # (1, end - begin, 256)
            total += F.cross_entropy(logits[0], tokens[begin + 1 : end + 1], reduction="sum").item()
    nll = total / usable
    return {"nll": nll, "bpb": nll / math.log(2), "ppl": math.exp(nll), "tokens": usable, "windows": len(pieces)}
