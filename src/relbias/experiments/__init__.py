"""Length extrapolation with tiny byte-level language models: data, training, evaluation, report.

The library never prints; progress goes through a ``progress`` hook (``tqdm.tqdm`` fits) and the
``relbias extrapolate`` command does the printing.
"""

from .data import Corpus, load_corpus, sample_batch, split_corpus
from .evaluate import (attention_window, check_reachable, check_windows, evaluate_lengths, evaluate_whole_text,
                       scored_bytes, training_window, window_plan)
from .model import VOCAB_SIZE, ByteLM, ByteLMConfig
from .positional import RotaryByteLM, SinusoidalByteLM
from .intervals import mean_interval, t_quantile
from .extrapolate import ExtrapolationConfig, default_scheme_options, known_schemes, run_extrapolation
from .train import TrainConfig, train_model

__all__ = [
    "VOCAB_SIZE",
    "ByteLM",
    "ByteLMConfig",
    "Corpus",
    "ExtrapolationConfig",
    "RotaryByteLM",
    "SinusoidalByteLM",
    "TrainConfig",
    "attention_window",
    "check_reachable",
    "check_windows",
    "default_scheme_options",
    "evaluate_lengths",
    "evaluate_whole_text",
    "known_schemes",
    "load_corpus",
    "mean_interval",
    "run_extrapolation",
    "sample_batch",
    "scored_bytes",
    "split_corpus",
    "t_quantile",
    "train_model",
    "training_window",
    "window_plan",
]
