"""Modules built on :func:`relbias.attention`: multi-head attention with a KV cache (the experiment's byte-level LM lives in
:mod:`relbias.experiments.model`)."""

from .attention import MultiheadAttention
from .cache import KVCache, StaticKVCache

__all__ = ["KVCache", "MultiheadAttention", "StaticKVCache"]
