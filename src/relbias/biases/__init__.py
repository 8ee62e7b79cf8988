"""Relative position bias families, one file each, all behind :class:`RelativeBias`.

Each family module registers itself in :data:`FAMILIES` when imported; the imports below run in the
registry's order (none, offset, t5, alibi, kerple_log, kerple_power, fire), so keep them in this order.
"""

from .registry import FAMILIES, make_bias, register_family  # first: holds "none"
from .base import CONVENTIONS, RelativeBias
from .native import NativeBias
from .table import TableBias
from .function import FunctionBias
from .offset import PerOffsetBias
from .t5 import T5Bias
from .alibi import ALiBiBias, alibi_slopes, mpt_alibi_slopes
from .kerple import KerpleLogBias, KerplePowerBias
from .fire import FIREBias

__all__ = ["ALiBiBias", "CONVENTIONS", "FAMILIES", "FIREBias", "FunctionBias", "KerpleLogBias", "KerplePowerBias", "NativeBias", "PerOffsetBias", "RelativeBias", "T5Bias", "TableBias", "alibi_slopes", "make_bias", "mpt_alibi_slopes", "register_family"]
