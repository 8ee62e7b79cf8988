"""The length-extrapolation experiment: one byte-level LM per position scheme, trained at length L and
evaluated at longer lengths (Press et al. 2022, ALiBi, "Train short, test long", §4)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..biases.registry import FAMILIES
from ..buckets import validate_t5_buckets
from .model import ByteLM, ByteLMConfig
from .data import Corpus, split_corpus
from .evaluate import check_reachable, evaluate_lengths, scored_bytes
from .report import load_results, require_matplotlib, save_results
from .train import Progress, TrainConfig, no_progress, train_model

__all__ = ["ExtrapolationConfig", "default_scheme_options", "run_extrapolation"]

RESULTS_VERSION = 1


def default_scheme_options(train_len: int, num_buckets: int = 32) -> dict[str, dict]:
    """Family options the experiment uses unless told otherwise.

    * "offset": ``out_of_range="clip"`` so that the per-offset model can be evaluated beyond L at all
      (offsets past L - 1 reuse u_{L-1}, Shaw et al. 2018 §3);
    * "t5": ``max_distance`` = the smallest value >= ``train_len`` that :func:`relbias.validate_t5_buckets`
      accepts for ``num_buckets`` causal buckets (64 for L = 64 and 32 buckets), so that every bucket is
      trained. T5 pairs max_distance 128 with inputs of 512 tokens; a max_distance above L would leave
      the buckets between L and max_distance without a gradient, holding their random initial values
      beyond L.
    """
    max_distance = max(train_len, num_buckets)  # when no value is valid, T5Bias reports why
    for candidate in range(max(train_len, num_buckets // 2 + 1), max(train_len, num_buckets) * 4):
        try:
            validate_t5_buckets(bidirectional=False, num_buckets=num_buckets, max_distance=candidate)
        except (TypeError, ValueError):
            continue
        max_distance = candidate
        break
    return {"offset": {"out_of_range": "clip"}, "t5": {"max_distance": max_distance}}


@dataclass(frozen=True)
class ExtrapolationConfig:
    """Everything that determines the experiment's numbers (the schemes aside).

    Attributes:
        train_len: training length L in tokens (bytes). Default 64.
        eval_lengths: evaluation lengths in tokens; default (L, 2L, 4L, 8L) = (64, 128, 256, 512).
        embed_dim, num_heads, num_layers: model size (:class:`relbias.experiments.ByteLMConfig`).
        train: a :class:`TrainConfig`.
        val_fraction: share of the corpus held out for evaluation, from its end. Default 0.1.
        max_eval_bytes: evaluate on at most this many held-out bytes (None: all). Default None.
        scheme_options: family name -> options for its factory; merged over
            :func:`default_scheme_options` (an entry replaces that family's defaults key by key).
        convention: score convention for every scheme; None uses each family's own.
        backend: attention backend; "auto" (default) lets relbias.dispatch pick per call.
    """

    train_len: int = 64
    eval_lengths: tuple[int, ...] = (64, 128, 256, 512)
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    train: TrainConfig = field(default_factory=TrainConfig)
    val_fraction: float = 0.1
    max_eval_bytes: int | None = None
    scheme_options: dict = field(default_factory=dict)
    convention: str | None = None
    backend: str = "auto"

    def options_for(self, scheme: str) -> dict:
        """Factory options of ``scheme``: the defaults, updated with ``scheme_options[scheme]``."""
        chosen = self.scheme_options.get(scheme, {})
        options = dict(default_scheme_options(self.train_len, chosen.get("num_buckets", 32)).get(scheme, {}))
        options.update(chosen)
        return options

    def model_config(self, scheme: str) -> ByteLMConfig:
        """The :class:`ByteLMConfig` of one scheme."""
        return ByteLMConfig(
            position=scheme, position_options=self.options_for(scheme), max_len=self.train_len,
            embed_dim=self.embed_dim, num_heads=self.num_heads, num_layers=self.num_layers,
            convention=self.convention, backend=self.backend,
        )

    def record(self, corpus: Corpus) -> dict:
        """The JSON-able record stored as ``results["config"]``; resuming requires it to be equal."""
        record = asdict(self)
        record.pop("train")
        record.update(asdict(self.train))
        record["eval_lengths"] = list(self.eval_lengths)
        record["corpus"], record["corpus_bytes"], record["corpus_sha256"] = corpus.name, len(corpus), corpus.sha256
        return record


def _check(config: ExtrapolationConfig, schemes: list[str], corpus: Corpus, train: torch.Tensor) -> list[ByteLM]:
    unknown = [s for s in schemes if s not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown scheme(s) {unknown}; registered families: {sorted(FAMILIES)}")
    if len(set(schemes)) != len(schemes):
        raise ValueError(f"schemes must not repeat, got {schemes}")
    if config.train_len >= len(train):
        raise ValueError(
            f"training length {config.train_len} is longer than the training split of corpus {corpus.name} "
            f"({len(train)} of its {len(corpus)} bytes); use a shorter --train-len or a larger corpus"
        )
    models = []
    for scheme in schemes:
        try:
            model = ByteLM(config.model_config(scheme))
        except (TypeError, ValueError) as exc:  # e.g. an option the family does not take
            raise ValueError(f"scheme {scheme!r} with options {config.options_for(scheme)}: {exc}") from exc
        for length in sorted(set(config.eval_lengths)):  # name the shortest length out of reach
            check_reachable(model, length)
        models.append(model)
    return models


def run_extrapolation(
    config: ExtrapolationConfig,
    schemes: list[str],
    corpus: Corpus,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: Progress = no_progress,
    on_result: Callable[[str, dict, dict], None] | None = None,
) -> dict:
    """Train and evaluate one model per scheme; write results after each one.

    Every model starts from ``torch.manual_seed(config.train.seed)`` and sees the same training
    windows, so the schemes differ only in their position bias. After each model, results.json,
    results.md and results.png in ``out_dir`` are replaced atomically (see :mod:`.report`), so an
    interrupted run keeps every finished model.

    Args:
        config: the :class:`ExtrapolationConfig`.
        schemes: family names, in run order.
        corpus: the :class:`~relbias.experiments.data.Corpus`.
        out_dir: output folder (created if missing).
        resume: keep the finished schemes of an existing results.json with the same config and run
            only the others; without it, existing results are replaced.
        progress: progress hook, e.g. ``tqdm.tqdm``.
        on_result: called as ``on_result(scheme, entry, results)`` after each model (and for each
            scheme taken from a resumed file, with ``entry["resumed"] = True``).

    Returns:
        The results dict as written to results.json: ``{"version", "config", "order", "schemes":
        {scheme: {"eval": {str(n): {"nll", "bpb", "ppl", "tokens"}}, "eval_tokens", "parameters",
        "train_seconds", "eval_seconds", "final_train_loss", "position_options"}}}``.

    Raises:
        ValueError: an unknown or repeated scheme; a training length not shorter than the training
            split; too little held-out text for the evaluation lengths; an evaluation length a scheme
            cannot reach (e.g. per-offset with ``out_of_range="error"``); a resumed file made with a
            different config. All are raised before any training.
        ImportError: matplotlib is missing.
    """
    require_matplotlib()
    train_tokens, val_tokens = split_corpus(corpus, config.val_fraction)
    if config.max_eval_bytes is not None:
        val_tokens = val_tokens[: config.max_eval_bytes]
    _check(config, schemes, corpus, train_tokens)
    scored_bytes(len(val_tokens), list(config.eval_lengths))  # too little held-out text: fail before training
    record = config.record(corpus)
    results = {"version": RESULTS_VERSION, "config": record, "order": list(schemes), "schemes": {}}
    if resume:
        previous = load_results(out_dir)
        if previous is not None:
            _check_same_config(previous["config"], record, Path(out_dir))
            results["schemes"] = {s: e for s, e in previous["schemes"].items() if s in schemes}
            results["order"] = list(schemes)
    for scheme in schemes:
        if scheme in results["schemes"]:
            if on_result is not None:
                on_result(scheme, {**results["schemes"][scheme], "resumed": True}, results)
            continue
        torch.manual_seed(config.train.seed)
        model = ByteLM(config.model_config(scheme))
        start = time.perf_counter()
        losses = train_model(model, train_tokens, config.train, progress=_labelled(progress, scheme))
        trained = time.perf_counter()
        scores = evaluate_lengths(model, val_tokens, list(config.eval_lengths), progress=_labelled(progress, scheme))
        entry = {
            "eval": {str(n): v for n, v in scores.items()},
            "eval_tokens": next(iter(scores.values()))["tokens"],
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": trained - start,
            "eval_seconds": time.perf_counter() - trained,
            "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
            "position_options": config.options_for(scheme),
        }
        results["schemes"][scheme] = entry
        save_results(out_dir, results)
        if on_result is not None:
            on_result(scheme, entry, results)
    save_results(out_dir, results)
    return results


def _labelled(progress: Progress, scheme: str) -> Progress:
    def hook(iterable, *, desc: str = "", **kwargs):
        return progress(iterable, desc=f"{scheme:>8} {desc}", **kwargs)

    return hook


def _check_same_config(previous: dict, current: dict, out_dir: Path) -> None:
    differing = sorted(k for k in previous.keys() | current.keys() if previous.get(k) != current.get(k))
    if differing:
        details = ", ".join(f"{k}: {previous.get(k)!r} there, {current.get(k)!r} now" for k in differing)
        raise ValueError(
            f"cannot resume: {out_dir / 'results.json'} was made with a different setup ({details}); "
            f"use another --out or run without --resume to start over"
        )
