"""Modules built on :func:`relbias.attention`: multi-head attention with torch.nn.MultiheadAttention's call
signature and return (``forward(query, key, value, ...) -> (output, weights or None)``, ``batch_first=False``
by default), plus relative position biases and KV caches for incremental decoding (the experiment's
byte-level LM lives in ``relbias.experiments.model``)."""

from .attention import MultiheadAttention
from .cache import KeyBlock, KVCache, StaticKVCache

__all__ = ["KVCache", "KeyBlock", "MultiheadAttention", "StaticKVCache"]
