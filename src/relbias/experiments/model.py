"""A tiny decoder-only language model over bytes, its position scheme a config field.

Bytes (UTF-8) are the tokens, so no tokenizer is needed: vocabulary 256. The model is a pre-norm
Transformer decoder (Radford et al. 2019, GPT-2 §2.3; read top to bottom like nanoGPT) with no
absolute position embedding: every position signal comes from the relative bias family named by
``ByteLMConfig.position`` (or none at all, NoPE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..backends import BACKENDS
from ..biases.registry import FAMILIES, make_bias
from ..nn.attention import MultiheadAttention
from ..nn.cache import KVCache, StaticKVCache

__all__ = ["VOCAB_SIZE", "ByteLMConfig", "ByteLM"]

#: One token per byte value.
VOCAB_SIZE = 256


@dataclass(frozen=True)
class ByteLMConfig:
    """Configuration of :class:`ByteLM`.

    Attributes:
        position: position scheme, any key of ``relbias.biases.FAMILIES`` ("none" = NoPE, "offset",
            "t5", ...; families registered later are accepted too). Default "t5".
        position_options: keyword options of the family's factory, e.g. ``{"out_of_range": "clip"}``
            for "offset". Default none.
        max_len: training length L in tokens (bytes); sizes per-offset tables. The model runs on any
            length; whether the bias can evaluate beyond L depends on the family. Default 64.
        embed_dim: model width E. Default 64.
        num_heads: attention heads H (must divide ``embed_dim``). Default 4.
        num_layers: decoder blocks. Default 2.
        mlp_ratio: hidden width of the MLP as a multiple of E. Default 4.
        share_position_bias: one bias module for every layer (as T5) when True (default), one per
            layer when False.
        convention: score convention of every layer; None (default) uses the family's own.
        backend: attention backend: "auto" (default) or a key of ``relbias.backends.BACKENDS``.

    Raises:
        ValueError: from :meth:`validate` (called by :class:`ByteLM`): an unknown family or backend,
            sizes < 1, ``embed_dim`` not divisible by ``num_heads``.
    """

    position: str = "t5"
    position_options: dict = field(default_factory=dict)
    max_len: int = 64
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    share_position_bias: bool = True
    convention: str | None = None
    backend: str = "auto"

    def validate(self) -> None:
        """Check the fields against the registries as they are now (families may be added at run time).

        Raises:
            ValueError: as in the class docstring.
        """
        if self.position not in FAMILIES:
            raise ValueError(f"unknown position scheme {self.position!r}; registered families: {sorted(FAMILIES)}")
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; available: {['auto', *sorted(BACKENDS)]}")
        for name in ("max_len", "embed_dim", "num_heads", "num_layers", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} must be divisible by num_heads {self.num_heads}")
        if not isinstance(self.position_options, dict):
            raise ValueError(f"position_options must be a dict, got {type(self.position_options).__name__}")


class _Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: ByteLMConfig, position_bias: nn.Module | None, context_parallel: dict) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.embed_dim)
        self.attn = MultiheadAttention(
            config.embed_dim, config.num_heads, batch_first=True, position_bias=position_bias, is_causal=True,
            backend=config.backend, convention=config.convention, **context_parallel,
        )
        self.ln_mlp = nn.LayerNorm(config.embed_dim)
        hidden = config.mlp_ratio * config.embed_dim
        self.mlp = nn.Sequential(nn.Linear(config.embed_dim, hidden), nn.GELU(), nn.Linear(hidden, config.embed_dim))

    def forward(self, x: torch.Tensor, cache, cache_position: int | None, cu_seqlens=None) -> torch.Tensor:
        h = self.ln_attn(x)
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        x = x + self.attn(h, h, h, need_weights=False, cache=cache, cache_position=cache_position, **packed)[0]
        return x + self.mlp(self.ln_mlp(x))


class ByteLM(nn.Module):
    """Decoder-only byte-level language model with a relative position scheme.

    Embedding (256 x E) -> ``num_layers`` causal pre-norm blocks -> LayerNorm -> logits through the
    tied embedding. No absolute position embedding.

    Args:
        config: a :class:`ByteLMConfig`.
        process_group: None (default) or the ranks over which every sequence is sharded along its length (context
            parallelism): a ``torch.distributed`` process group or a 1-D ``DeviceMesh`` (``mesh["cp"]``). Each rank
            then passes its shard of the tokens (:func:`relbias.distributed.shard`, ``dim=1``, in ``cp_layout``)
            and gets the logits of its shard; attention runs
            :func:`relbias.distributed.context_parallel_attention` at global positions.
        cp_layout: with ``process_group``: "contiguous" (default) or "zigzag".
        cp_sync_bias_grads: with ``process_group``: True (default) sums the position biases' gradients over the
            group; False leaves each rank its part, like every other parameter's, for FSDP2 or DDP reducing over
            the context-parallel ranks too (:class:`relbias.nn.MultiheadAttention`).

    Attributes:
        position_biases: the bias modules in use (one if shared, one per layer otherwise; empty for
            "none").

    Raises:
        ValueError: an invalid config (see :meth:`ByteLMConfig.validate`); errors of the family factory and of
            :class:`relbias.nn.MultiheadAttention`'s context-parallel arguments.

    Example:
        >>> model = ByteLM(ByteLMConfig(position="t5", max_len=32))
        >>> tokens = torch.tensor([list(b"hello world")])      # (1, 11) int64 bytes
        >>> model(tokens).shape                                # (batch, seq_len, 256) logits
        torch.Size([1, 11, 256])
    """

    def __init__(
        self,
        config: ByteLMConfig,
        *,
        process_group: object = None,
        cp_layout: str = "contiguous",
        cp_sync_bias_grads: bool = True,
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        context_parallel = {} if process_group is None else {
            "process_group": process_group, "cp_layout": cp_layout, "cp_sync_bias_grads": cp_sync_bias_grads,
        }

        def new_bias():
            return make_bias(
                config.position, num_heads=config.num_heads, max_len=config.max_len, bidirectional=False,
                **config.position_options,
            )

        shared = new_bias() if config.share_position_bias else None
        biases = [shared if config.share_position_bias else new_bias() for _ in range(config.num_layers)]
        self.position_biases = nn.ModuleList({id(b): b for b in biases if b is not None}.values())
        self.embed = nn.Embedding(VOCAB_SIZE, config.embed_dim)
        self.blocks = nn.ModuleList(_Block(config, b, context_parallel) for b in biases)
        self.ln_out = nn.LayerNorm(config.embed_dim)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def make_cache(
        self, batch: int, *, capacity: int | None = None, dtype: torch.dtype = torch.float32
    ) -> list[KVCache] | list[StaticKVCache]:
        """One KV cache per layer: growing (:class:`KVCache`) by default, pre-allocated with ``capacity``.

        Args:
            batch: B.
            capacity: tokens for a :class:`StaticKVCache`; None for growing caches.
            dtype: dtype of pre-allocated buffers.
        """
        if capacity is None:
            return [KVCache() for _ in self.blocks]
        c = self.config
        device = self.embed.weight.device
        return [
            StaticKVCache(batch, c.num_heads, capacity, c.embed_dim // c.num_heads, dtype=dtype, device=device)
            for _ in self.blocks
        ]

    def forward(
        self, tokens: torch.Tensor, *, cache: list | None = None, cache_position: int | None = None,
        cu_seqlens: torch.Tensor | list[int] | None = None,
    ) -> torch.Tensor:
        """Next-byte logits for every position.

        Args:
            tokens: int64 (B, L), byte values in [0, 255]; under ``process_group``, this rank's shard (B, L/P).
            cache: from :meth:`make_cache`, to decode incrementally; the tokens sit at positions
                ``cache_position .. cache_position + L - 1``.
            cache_position: absolute position (tokens) of ``tokens[:, 0]``; default the caches' length
                (append), or 0 without a cache.
            cu_seqlens: packed training without padding: ``tokens`` (1, T) holds several documents concatenated,
                ``cu_seqlens`` their N + 1 boundaries (0, ..., T); each byte attends only within its document, at
                positions restarting from 0 (:func:`relbias.attention_varlen`). The logits of a document's last
                byte score the next document's first: leave those targets out of the loss.

        Returns:
            float32 logits (B, L, 256); entry (b, t) scores the byte after ``tokens[b, t]``.

        Raises:
            TypeError: tokens not an integer tensor.
            ValueError: tokens not 2-D or outside [0, 255]; a cache list of the wrong length; errors of
                the attention layers (e.g. a per-offset bias asked beyond ``max_len`` with clipping off).
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32, torch.uint8):
            kind = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise TypeError(f"tokens must be an integer tensor of byte values, got {kind}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= VOCAB_SIZE):
            raise ValueError(f"tokens must be byte values in [0, {VOCAB_SIZE - 1}], got {int(tokens.min())}..{int(tokens.max())}")
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache must hold one entry per layer ({len(self.blocks)}), got {len(cache)}")
        if cache is not None and cache_position is None:
            cache_position = cache[0].length
        x = self.embed(tokens.long())  # (B, L, E)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i], cache_position, cu_seqlens)
        return self.ln_out(x) @ self.embed.weight.T  # (B, L, E) @ (E, 256) -> (B, L, 256)
