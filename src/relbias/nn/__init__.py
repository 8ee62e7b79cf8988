"""Modules built on :func:`relbias.attention`: multi-head attention with a KV cache, a tiny byte-level LM."""

from .attention import MultiheadAttention
from .cache import KVCache, StaticKVCache
from .lm import VOCAB_SIZE, ByteLM, ByteLMConfig

__all__ = ["VOCAB_SIZE", "ByteLM", "ByteLMConfig", "KVCache", "MultiheadAttention", "StaticKVCache"]
