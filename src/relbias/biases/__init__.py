"""Relative position bias families, one file each, all behind :class:`RelativeBias`."""

from .base import CONVENTIONS, NativeBias, RelativeBias, TableBias
from .function import FunctionBias
from .offset import PerOffsetBias
from .t5 import T5Bias

__all__ = ["CONVENTIONS", "FunctionBias", "NativeBias", "PerOffsetBias", "RelativeBias", "T5Bias", "TableBias"]
