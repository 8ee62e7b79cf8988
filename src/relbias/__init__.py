"""relbias: self-attention with relative position biases for PyTorch."""

from .biases import CONVENTIONS, FunctionBias, NativeBias, PerOffsetBias, RelativeBias, T5Bias, TableBias
from .biases import ALiBiBias, FIREBias, KerpleLogBias, KerplePowerBias, alibi_slopes
from .buckets import t5_bucket, t5_bucket_ranges, validate_t5_buckets
from .dispatch import explain_backend
from .functional import attention, attention_with_weights
from .positions import Alignment, relative_offsets, resolve_alignment

__version__ = "0.1.0"

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
    "attention",
    "attention_with_weights",
    "explain_backend",
    "relative_offsets",
    "resolve_alignment",
    "t5_bucket",
    "t5_bucket_ranges",
    "validate_t5_buckets",
]
