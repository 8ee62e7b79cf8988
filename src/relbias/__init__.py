"""relbias: self-attention with relative position biases for PyTorch."""

from .biases import CONVENTIONS, FunctionBias, NativeBias, PerOffsetBias, RelativeBias, T5Bias, TableBias
from .biases import ALiBiBias, FIREBias, KerpleLogBias, KerplePowerBias, alibi_slopes, mpt_alibi_slopes
from .buckets import t5_bucket, t5_bucket_ranges, validate_t5_buckets
from .dispatch import explain_backend
from .functional import attention, attention_with_weights
from .positions import Alignment, relative_offsets, resolve_alignment
from .varlen import attention_varlen

__version__ = "0.1.0"

#: Subpackages reachable as ``relbias.NAME`` after ``import relbias`` (imported on first use).
_SUBMODULES = ("backends", "benchmark", "biases", "call", "distributed", "experiments", "integrations", "nn")


def __getattr__(name: str):
    """``relbias.nn``, ``relbias.experiments``, ... without a separate import (PEP 562)."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'relbias' has no attribute {name!r}")

__all__ = [
    "ALiBiBias",
    "CONVENTIONS",
    "Alignment",
    "FIREBias",
    "FunctionBias",
    "KerpleLogBias",
    "KerplePowerBias",
    "NativeBias",
    "PerOffsetBias",
    "RelativeBias",
    "T5Bias",
    "TableBias",
    "alibi_slopes",
    "mpt_alibi_slopes",
    "attention",
    "attention_varlen",
    "attention_with_weights",
    "explain_backend",
    "relative_offsets",
    "resolve_alignment",
    "t5_bucket",
    "t5_bucket_ranges",
    "validate_t5_buckets",
]
