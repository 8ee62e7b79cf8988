"""relbias: self-attention with relative position biases for PyTorch."""

from .biases import CONVENTIONS, FunctionBias, NativeBias, PerOffsetBias, RelativeBias, T5Bias, TableBias
from .buckets import t5_bucket, t5_bucket_ranges, validate_t5_buckets
from .functional import attention
from .positions import Alignment, relative_offsets, resolve_alignment

__version__ = "0.1.0"

__all__ = [
    "CONVENTIONS",
    "Alignment",
    "FunctionBias",
    "NativeBias",
    "PerOffsetBias",
    "RelativeBias",
    "T5Bias",
    "TableBias",
    "attention",
    "relative_offsets",
    "resolve_alignment",
    "t5_bucket",
    "t5_bucket_ranges",
    "validate_t5_buckets",
]
