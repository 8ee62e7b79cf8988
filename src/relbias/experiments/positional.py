"""The baselines every extrapolation table compares against, which are not relative biases: sinusoidal absolute
positions (Vaswani et al. 2017, §3.5) and rotary embeddings (Su et al. 2021, RoFormer, §3.4).

Both are :class:`~relbias.experiments.ByteLM` models without a position bias (``position="none"``) whose
position signal enters elsewhere: the sinusoids are added to the token embeddings, the rotations are applied to
every layer's queries and keys. They live here, in the experiment, and not among ``relbias.biases.FAMILIES``:
neither is a bias added to the attention scores.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import attention
from .model import ByteLM, ByteLMConfig

__all__ = ["BASELINES", "sinusoidal_positions", "rotary_angles", "apply_rotary", "SinusoidalByteLM",
           "RotaryByteLM", "make_baseline"]

#: Base of the geometric progression of wavelengths in both papers (10000).
BASE = 10000.0


def sinusoidal_positions(length: int, dim: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The sinusoidal position encoding of Vaswani et al. 2017, §3.5.

    ``PE[pos, 2i] = sin(pos / 10000^(2i / dim))``, ``PE[pos, 2i + 1] = cos(pos / 10000^(2i / dim))``.

    Args:
        length: positions 0 .. length - 1 (tokens), an int >= 0.
        dim: encoding width, an even int >= 2 (the model width E).
        dtype: of the result; computed in float64 first. Default float32.

    Returns:
        (length, dim) tensor, values in [-1, 1].

    Raises:
        ValueError: ``length`` < 0 or ``dim`` not an even int >= 2.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"the sinusoidal encoding needs an even width >= 2, got {dim!r}")
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (length, 1)
    inv = BASE ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,) 1 / 10000^(2i/dim)
    out = torch.empty(length, dim, dtype=torch.float64)
    out[:, 0::2], out[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
    return out.to(dtype)


def rotary_angles(length: int, head_dim: int) -> torch.Tensor:
    """Rotation angles of RoFormer (Su et al. 2021, §3.4.2, eq. 15): ``m * theta_i``, ``theta_i = 10000^(-2i/d)``.

    Args:
        length: positions m = 0 .. length - 1 (tokens), an int >= 0.
        head_dim: d, an even int >= 2.

    Returns:
        float64 (length, head_dim / 2) angles in radians; column i rotates the pair (2i, 2i + 1).

    Raises:
        ValueError: ``length`` < 0 or ``head_dim`` not an even int >= 2.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head width >= 2, got {head_dim!r}")
    theta = BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return torch.arange(length, dtype=torch.float64)[:, None] * theta  # (length, d/2)


def apply_rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of features (2i, 2i + 1) of the token at position m by ``m * theta_i`` (RoFormer eq. 34).

    ``out[..., 2i] = x[..., 2i] cos - x[..., 2i + 1] sin``, ``out[..., 2i + 1] = x[..., 2i] sin + x[..., 2i + 1]
    cos``; positions count from 0 along the second-to-last dimension. Then ``<R_m q, R_n k>`` depends on q, k and
    m - n only.

    Args:
        x: floating (..., L, d) queries or keys, d even.

    Returns:
        Tensor of x's shape and dtype.

    Raises:
        ValueError: ``x`` with fewer than 2 dimensions or an odd last dimension.
    """
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"apply_rotary expects (..., seq_len, even head_dim), got shape {tuple(x.shape)}")
    angles = rotary_angles(x.shape[-2], x.shape[-1]).to(device=x.device, dtype=x.dtype)  # (L, d/2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class _ScaledSinusoidalEmbedding(nn.Embedding):
    """Token embedding times sqrt(E) plus the sinusoidal encoding of positions 0 .. L - 1 (Vaswani et al. §3.4-5)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens) * math.sqrt(self.embedding_dim)  # (B, L, E)
        return x + sinusoidal_positions(tokens.shape[-1], self.embedding_dim).to(x)


class _RotaryAttention(nn.Module):
    """Causal self-attention with rotary queries and keys, reusing a MultiheadAttention's four projections.

    ``window`` (None, or ``(left, right)`` as :func:`relbias.attention` takes it) limits the keys each query sees;
    a windowed call runs :func:`relbias.attention` without a bias (the same scores as SDPA's) on the layer's
    backend, an unwindowed one ``scaled_dot_product_attention``."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.head_dim = base.num_heads, base.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = base.q_proj, base.k_proj, base.v_proj, base.out_proj
        self.backend = base.backend
        self.window = None

    def forward(self, query: torch.Tensor, key=None, value=None, **_: object) -> tuple[torch.Tensor, None]:
        b, n, e = query.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)

        q, k = apply_rotary(heads(self.q_proj(query))), apply_rotary(heads(self.k_proj(query)))
        if self.window is None:
            out = F.scaled_dot_product_attention(q, k, heads(self.v_proj(query)), is_causal=True)  # (B, H, L, D)
        else:
            out = attention(q, k, heads(self.v_proj(query)), is_causal=True, window=self.window,
                            backend=self.backend)  # (B, H, L, D)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e)), None


class _WindowOnly:
    """Baselines score whole windows from position 0: no KV-cache decoding."""

    def forward(self, tokens: torch.Tensor, *, cache: list | None = None, cache_position: int | None = None):
        if cache is not None or cache_position:
            raise ValueError(f"the {self.scheme!r} baseline scores whole windows from position 0; it has no cache")
        return super().forward(tokens)


class SinusoidalByteLM(_WindowOnly, ByteLM):
    """:class:`ByteLM` without a bias, its embeddings scaled by sqrt(E) plus sinusoidal absolute positions
    (Vaswani et al. 2017, §3.4 and §3.5); the tied output head reads the unscaled embedding.

    Args:
        config: a :class:`ByteLMConfig`; its ``position`` is replaced by "none", E (``embed_dim``) must be even.

    Raises:
        ValueError: an odd ``embed_dim``; as :class:`ByteLM`. The forward pass refuses ``cache`` (no decoding).
    """

    scheme = "sinusoidal"

    def __init__(self, config: ByteLMConfig) -> None:
        if config.embed_dim % 2:
            raise ValueError(f"the sinusoidal baseline needs an even embed_dim, got {config.embed_dim}")
        super().__init__(replace(config, position="none", position_options={}))
        embed = _ScaledSinusoidalEmbedding(self.embed.num_embeddings, self.embed.embedding_dim)
        embed.weight = self.embed.weight  # the same initial values, tied to the output head as before
        self.embed = embed


class RotaryByteLM(_WindowOnly, ByteLM):
    """:class:`ByteLM` without a bias whose every layer rotates queries and keys (RoFormer, Su et al. 2021, §3.4).

    Same parameters (and, under one seed, the same initial values) as ``ByteLM(position="none")``; attention runs
    ``torch.nn.functional.scaled_dot_product_attention`` with the causal mask (:func:`relbias.attention` when a
    window is set on a layer, as :func:`~relbias.experiments.evaluate.attention_window` does).

    Args:
        config: a :class:`ByteLMConfig`; its ``position`` is replaced by "none"; the head width E / H must be even.

    Raises:
        ValueError: an odd head width; as :class:`ByteLM`. The forward pass refuses ``cache`` (no decoding).
    """

    scheme = "rotary"

    def __init__(self, config: ByteLMConfig) -> None:
        if config.embed_dim % config.num_heads == 0 and (config.embed_dim // config.num_heads) % 2:
            raise ValueError(
                f"the rotary baseline needs an even head width, got embed_dim {config.embed_dim} / "
                f"num_heads {config.num_heads} = {config.embed_dim // config.num_heads}"
            )
        super().__init__(replace(config, position="none", position_options={}))
        for block in self.blocks:
            block.attn = _RotaryAttention(block.attn)


#: Scheme name -> model class of the baselines.
BASELINES = {"sinusoidal": SinusoidalByteLM, "rotary": RotaryByteLM}


def make_baseline(scheme: str, config: ByteLMConfig) -> ByteLM:
    """The baseline model named ``scheme`` ("sinusoidal" or "rotary") with ``config``'s sizes.

    Raises:
        ValueError: an unknown ``scheme`` (naming the baselines); errors of the model classes.
    """
    if scheme not in BASELINES:
        raise ValueError(f"unknown baseline {scheme!r}; baselines: {sorted(BASELINES)}")
    return BASELINES[scheme](config)
