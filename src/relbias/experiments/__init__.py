"""Length extrapolation with tiny byte-level language models: data, training, evaluation, report.

The library never prints; progress goes through a ``progress`` hook (``tqdm.tqdm`` fits) and the
``relbias extrapolate`` command does the printing.
"""

from .data import Corpus, load_corpus, sample_batch, split_corpus
from .evaluate import check_reachable, evaluate_lengths, scored_bytes
from .model import VOCAB_SIZE, ByteLM, ByteLMConfig
from .extrapolate import ExtrapolationConfig, default_scheme_options, run_extrapolation
from .train import TrainConfig, train_model

__all__ = [
    "VOCAB_SIZE",
    "ByteLM",
    "ByteLMConfig",
    "Corpus",
    "ExtrapolationConfig",
    "TrainConfig",
    "check_reachable",
    "default_scheme_options",
    "evaluate_lengths",
    "load_corpus",
    "run_extrapolation",
    "sample_batch",
    "scored_bytes",
    "split_corpus",
    "train_model",
]
