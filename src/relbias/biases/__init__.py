"""Relative position bias families, one file each, all behind :class:`RelativeBias`."""

from .base import CONVENTIONS, NativeBias, RelativeBias, TableBias
from .function import FunctionBias
from .offset import PerOffsetBias
from .t5 import T5Bias
from .registry import FAMILIES, make_bias, register_family

__all__ = ["CONVENTIONS", "FAMILIES", "FunctionBias", "NativeBias", "PerOffsetBias", "RelativeBias", "T5Bias", "TableBias", "make_bias", "register_family"]
