"""The length-extrapolation experiment: one byte-level LM per position scheme, trained at length L and
evaluated at longer lengths (Press et al. 2022, ALiBi, "Train short, test long", §4)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..biases.registry import FAMILIES
from ..buckets import validate_t5_buckets
from .model import ByteLM, ByteLMConfig
from .data import Corpus, split_corpus
from .evaluate import (EVAL_MODES, MIN_WINDOWS, WHOLE_TEXT_TOKENS, check_reachable, check_windows, evaluate_lengths,
                       evaluate_whole_text, scored_bytes, training_window)
from .positional import BASELINES, make_baseline
from .report import WHOLE_TEXT, load_results, require_matplotlib, save_results, summarize
from .train import Progress, TrainConfig, no_progress, train_model

__all__ = ["ExtrapolationConfig", "default_scheme_options", "known_schemes", "build_model", "run_extrapolation"]

#: 2: runs per (scheme, seed) under ``schemes[s]["runs"]``, with a summary across seeds.
RESULTS_VERSION = 2


def known_schemes() -> list[str]:
    """Every scheme the experiment runs: the registered bias families (now), then the baselines of
    :mod:`relbias.experiments.positional` ("sinusoidal", "rotary")."""
    return [*FAMILIES, *(b for b in BASELINES if b not in FAMILIES)]


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
        eval_mode: "nonoverlapping" (default) or "sliding" windows (Press et al. 2022, §4;
            :func:`~relbias.experiments.evaluate.window_plan`).
        stride: with "sliding", the stride S in tokens, 1 <= S <= every evaluation length; None (default)
            means ``train_len``. Ignored (recorded as None) for "nonoverlapping".
        min_windows: fewest non-overlapping windows the scored held-out bytes must give at every evaluation
            length (:func:`~relbias.experiments.evaluate.check_windows`). Default 8.
        windowed_eval: also evaluate every model with attention limited to the training length, beside full
            attention (default True): every attention layer runs with ``window = (L - 1, 0)``, each byte's query
            seeing itself and at most L - 1 earlier bytes, at every evaluation length (the same windows of bytes
            as full attention) and once over the whole scored text in one forward
            (:func:`~relbias.experiments.evaluate.evaluate_whole_text`). Costs O(n·L) per length n with a fused
            backend, a few seconds per model at the default lengths.
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
    eval_mode: str = "nonoverlapping"
    stride: int | None = None
    min_windows: int = MIN_WINDOWS
    windowed_eval: bool = True

    def eval_stride(self) -> int | None:
        """The sliding stride in effect: ``stride`` or ``train_len``; None for non-overlapping evaluation."""
        if self.eval_mode != "sliding":
            return None
        return self.train_len if self.stride is None else self.stride

    def eval_window(self) -> tuple[int, int] | None:
        """The attention window of the windowed evaluation, ``(train_len - 1, 0)``; None without it."""
        return training_window(self.train_len) if self.windowed_eval else None

    def options_for(self, scheme: str) -> dict:
        """Factory options of ``scheme``: the defaults, updated with ``scheme_options[scheme]`` (none for a
        baseline)."""
        if scheme in BASELINES and scheme not in FAMILIES:
            return {}
        chosen = self.scheme_options.get(scheme, {})
        options = dict(default_scheme_options(self.train_len, chosen.get("num_buckets", 32)).get(scheme, {}))
        options.update(chosen)
        return options

    def model_config(self, scheme: str) -> ByteLMConfig:
        """The :class:`ByteLMConfig` of one scheme (``position="none"`` for a baseline)."""
        return ByteLMConfig(
            position="none" if scheme in BASELINES and scheme not in FAMILIES else scheme, position_options=self.options_for(scheme), max_len=self.train_len,
            embed_dim=self.embed_dim, num_heads=self.num_heads, num_layers=self.num_layers,
            convention=self.convention, backend=self.backend,
        )

    def record(self, corpus: Corpus) -> dict:
        """The JSON-able record stored as ``results["config"]``; resuming requires it to be equal."""
        record = asdict(self)
        record.pop("train")
        record.update(asdict(self.train))
        record.pop("seed")  # the seeds are the run's set, like the schemes: results["seeds"]
        record["stride"] = self.eval_stride()
        record.pop("windowed_eval")  # a file made before the windowed evaluation resumes as one made without it
        if self.windowed_eval:
            record["eval_window"] = list(self.eval_window())
        record["eval_lengths"] = list(self.eval_lengths)
        record["corpus"], record["corpus_bytes"], record["corpus_sha256"] = corpus.name, len(corpus), corpus.sha256
        return record


def build_model(config: ExtrapolationConfig, scheme: str) -> ByteLM:
    """The untrained model of ``scheme`` (a bias family or a baseline) with ``config``'s sizes.

    Raises:
        ValueError: an option the family does not take, or another error of the model, naming the scheme.
    """
    try:
        if scheme in BASELINES and scheme not in FAMILIES:
            return make_baseline(scheme, config.model_config(scheme))
        return ByteLM(config.model_config(scheme))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"scheme {scheme!r} with options {config.options_for(scheme)}: {exc}") from exc


def _check_seeds(seeds: list[int]) -> None:
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of ints >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must not repeat, got {seeds}")


def _check(config: ExtrapolationConfig, schemes: list[str], corpus: Corpus, train: torch.Tensor) -> list[ByteLM]:
    unknown = [s for s in schemes if s not in known_schemes()]
    if unknown:
        raise ValueError(
            f"unknown scheme(s) {unknown}; registered families: {sorted(FAMILIES)}, baselines: {sorted(BASELINES)}"
        )
    if len(set(schemes)) != len(schemes):
        raise ValueError(f"schemes must not repeat, got {schemes}")
    if not isinstance(config.windowed_eval, bool):
        raise ValueError(f"windowed_eval must be a bool, got {config.windowed_eval!r}")
    if config.eval_mode not in EVAL_MODES:
        raise ValueError(f"unknown evaluation mode {config.eval_mode!r}; expected one of {EVAL_MODES}")
    stride = config.eval_stride()
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int)
                               or not 1 <= stride <= min(config.eval_lengths)):
        raise ValueError(
            f"sliding stride must be an int in [1, {min(config.eval_lengths)}] (the shortest evaluation length), "
            f"got {stride!r}"
        )
    if config.train_len >= len(train):
        raise ValueError(
            f"training length {config.train_len} is longer than the training split of corpus {corpus.name} "
            f"({len(train)} of its {len(corpus)} bytes); use a shorter --train-len or a larger corpus"
        )
    models = []
    for scheme in schemes:
        model = build_model(config, scheme)
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
    seeds: list[int] | None = None,
    resume: bool = False,
    progress: Progress = no_progress,
    on_result: Callable[[str, dict, dict], None] | None = None,
) -> dict:
    """Train and evaluate one model per scheme and seed; write results after each one.

    The run of seed s starts from ``torch.manual_seed(s)`` (initialisation) and draws its training windows
    from a generator seeded with s (batch order), so under one seed the schemes differ only in their position
    scheme, and across seeds in initialisation and batches. Seeds run in the outer loop: after the first seed,
    every scheme has a number. After each model, results.json, results.md and results.png in ``out_dir`` are
    replaced atomically (see :mod:`.report`), so an interrupted run keeps every finished model.

    Args:
        config: the :class:`ExtrapolationConfig`; its ``train.seed`` is the default seed list.
        schemes: bias families and baselines (:func:`known_schemes`), in run order.
        corpus: the :class:`~relbias.experiments.data.Corpus`.
        out_dir: output folder (created if missing).
        seeds: ints >= 0, distinct; default ``[config.train.seed]``.
        resume: keep the finished (scheme, seed) runs of an existing results.json with the same config and
            run only the others; without it, existing results are replaced.
        progress: progress hook, e.g. ``tqdm.tqdm``.
        on_result: called as ``on_result(scheme, entry, results)`` after each model (and for each run taken
            from a resumed file, with ``entry["resumed"] = True``); ``entry["seed"]`` is its seed.

    Returns:
        The results dict as written to results.json: ``{"version": 2, "config", "order", "seeds", "schemes":
        {scheme: {"runs": {str(seed): {"seed", "eval": {str(n): {"nll", "bpb", "ppl", "tokens", "windows"}},
        "eval_tokens", "parameters", "train_seconds", "eval_seconds", "final_train_loss", "position_options"}},
        "summary": {str(n): {metric: mean_interval}}}}}`` (:func:`~relbias.experiments.report.summarize`).
        With ``config.windowed_eval``, ``config["eval_window"]`` is ``[L - 1, 0]``, each run also has
        ``"eval_windowed"`` (``"eval"``'s entries under the window, plus ``"whole_text"``: the scored bytes in
        one windowed forward) and ``"windowed_seconds"``, and each scheme ``"summary_windowed"``.

    Raises:
        ValueError: an unknown or repeated scheme or seed; a training length not shorter than the training
            split; too little held-out text for the evaluation lengths, or fewer than ``config.min_windows``
            windows at one of them; an evaluation length a scheme cannot reach (e.g. per-offset with
            ``out_of_range="error"``); an unknown evaluation mode or a bad stride; a resumed file made with a
            different config. All are raised before any training.
        ImportError: matplotlib is missing.
    """
    require_matplotlib()
    seeds = [config.train.seed] if seeds is None else list(seeds)
    _check_seeds(seeds)
    train_tokens, val_tokens = split_corpus(corpus, config.val_fraction)
    if config.max_eval_bytes is not None:
        val_tokens = val_tokens[: config.max_eval_bytes]
    _check(config, schemes, corpus, train_tokens)
    usable = scored_bytes(len(val_tokens), list(config.eval_lengths))  # too little held-out text: before training
    check_windows(usable, list(config.eval_lengths), config.train_len, config.min_windows)
    record = config.record(corpus)
    results = {"version": RESULTS_VERSION, "config": record, "order": list(schemes), "seeds": list(seeds),
               "schemes": {s: {"runs": {}} for s in schemes}}
    if resume:
        previous = load_results(out_dir)
        if previous is not None:
            if previous.get("version") != RESULTS_VERSION:
                raise ValueError(
                    f"cannot resume: {Path(out_dir) / 'results.json'} has results version "
                    f"{previous.get('version')!r}, this code writes {RESULTS_VERSION}; use another --out"
                )
            _check_same_config(previous["config"], record, Path(out_dir))
            for scheme in schemes:
                runs = previous["schemes"].get(scheme, {}).get("runs", {})
                results["schemes"][scheme]["runs"] = {k: e for k, e in runs.items() if int(k) in seeds}
    lengths = list(config.eval_lengths)
    for seed in seeds:
        for scheme in schemes:
            runs = results["schemes"][scheme]["runs"]
            if str(seed) in runs:
                if on_result is not None:
                    on_result(scheme, {**runs[str(seed)], "resumed": True}, results)
                continue
            torch.manual_seed(seed)
            model = build_model(config, scheme)
            start = time.perf_counter()
            losses = train_model(model, train_tokens, replace(config.train, seed=seed),
                                 progress=_labelled(progress, scheme, seed))
            trained = time.perf_counter()
            scores = evaluate_lengths(model, val_tokens, lengths, mode=config.eval_mode, stride=config.eval_stride(),
                                      progress=_labelled(progress, scheme, seed))
            evaluated = time.perf_counter()
            windowed = _evaluate_windowed(config, model, val_tokens, _labelled(progress, scheme, seed))
            entry = {
                "seed": seed,
                "eval": {str(n): v for n, v in scores.items()},
                "eval_tokens": next(iter(scores.values()))["tokens"],
                "parameters": sum(p.numel() for p in model.parameters()),
                "train_seconds": trained - start,
                "eval_seconds": evaluated - trained,
                "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
                "position_options": config.options_for(scheme),
            }
            if windowed is not None:
                entry["eval_windowed"] = windowed
                entry["windowed_seconds"] = time.perf_counter() - evaluated
            runs[str(seed)] = entry
            _summarize_all(results)
            save_results(out_dir, results)
            if on_result is not None:
                on_result(scheme, entry, results)
    _summarize_all(results)
    save_results(out_dir, results)
    return results


def _evaluate_windowed(config: ExtrapolationConfig, model: ByteLM, val_tokens: torch.Tensor,
                       progress: Progress) -> dict | None:
    """The windowed scores of one model: ``{str(n): scores, "whole_text": scores}``, or None without them."""
    window = config.eval_window()
    if window is None:
        return None
    lengths = list(config.eval_lengths)
    scores = evaluate_lengths(model, val_tokens, lengths, mode=config.eval_mode, stride=config.eval_stride(),
                              window=window, progress=progress)
    # The reference backend materialises every score of a forward: keep its pieces small.
    max_tokens = 4096 if config.backend == "reference" else WHOLE_TEXT_TOKENS
    whole = evaluate_whole_text(model, val_tokens, lengths, window, max_tokens=max_tokens, progress=progress)
    return {**{str(n): v for n, v in scores.items()}, WHOLE_TEXT: whole}


def _summarize_all(results: dict) -> None:
    lengths = results["config"]["eval_lengths"]
    for scheme, block in results["schemes"].items():
        runs = [block["runs"][str(s)] for s in results["seeds"] if str(s) in block["runs"]]
        block["summary"] = summarize(runs, lengths) if runs else {}
        if results["config"].get("eval_window") is not None:
            block["summary_windowed"] = summarize(runs, [*lengths, WHOLE_TEXT], field="eval_windowed") if runs else {}


def _labelled(progress: Progress, scheme: str, seed: int) -> Progress:
    def hook(iterable, *, desc: str = "", **kwargs):
        return progress(iterable, desc=f"{scheme:>12} seed {seed} {desc}", **kwargs)

    return hook


def _check_same_config(previous: dict, current: dict, out_dir: Path) -> None:
    differing = sorted(k for k in previous.keys() | current.keys() if previous.get(k) != current.get(k))
    if differing:
        details = ", ".join(f"{k}: {previous.get(k)!r} there, {current.get(k)!r} now" for k in differing)
        hint = ""
        if differing == ["eval_window"] and previous.get("eval_window") is None:
            hint = ", or resume it without the windowed evaluation (windowed_eval=False, --no-windowed-eval)"
        raise ValueError(
            f"cannot resume: {out_dir / 'results.json'} was made with a different setup ({details}); "
            f"use another --out or run without --resume to start over{hint}"
        )
