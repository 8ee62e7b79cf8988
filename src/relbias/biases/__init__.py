"""Relative position bias families, one file each, all behind :class:`RelativeBias`."""

from .alibi import ALiBiBias, alibi_slopes
from .base import CONVENTIONS, NativeBias, RelativeBias, TableBias
from .fire import FIREBias
from .function import FunctionBias
from .kerple import KerpleLogBias, KerplePowerBias
from .offset import PerOffsetBias
from .t5 import T5Bias
from .registry import FAMILIES, make_bias, register_family

__all__ = ["ALiBiBias", "CONVENTIONS", "FAMILIES", "FIREBias", "FunctionBias", "KerpleLogBias", "KerplePowerBias", "NativeBias", "PerOffsetBias", "RelativeBias", "T5Bias", "TableBias", "alibi_slopes", "make_bias", "register_family"]
