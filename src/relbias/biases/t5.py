"""T5's bucketed relative position bias (Raffel et al. 2020, JMLR 21(140), §2.1)."""

from __future__ import annotations

import torch
from torch import nn

from .._int_args import check_int
from ..buckets import t5_bucket, t5_bucket_ranges, validate_t5_buckets
from .registry import register_family
from .table import TableBias

__all__ = ["T5Bias"]


#: (bidirectional, num_buckets, max_distance) -> saturation distance (tokens), filled on first use per setting.
_SATURATION: dict[tuple[bool, int, int], int] = {}


class T5Bias(TableBias):
    """T5 relative position bias: one learnable scalar per bucket and head, ``PE(i, j) = u_{b(i-j), h}``.

    The bucket function ``b`` is :func:`relbias.t5_bucket`. Used by default with T5's unscaled scores,
    ``(q.k) + u_{b(i-j)} + Mask`` (score convention "t5", docs/conventions.md). Like Hugging Face's
    ``relative_attention_bias``, one module is computed once per stack and shared by every layer.

    Args:
        num_heads: number of heads H, >= 1.
        num_buckets: number of buckets (T5: 32).
        max_distance: distance in tokens where the log region ends (T5: 128).
        bidirectional: True (default) for encoders, False for causal decoder self-attention.
        init_std: standard deviation of the normal initialisation; default ``512 ** -0.5`` (0.0442), what
            Hugging Face uses for t5-small (``factor * d_model ** -0.5``).

    Attributes:
        weight: float32 parameter (num_buckets, num_heads), the layout of Hugging Face's
            ``relative_attention_bias.weight``, so its state loads directly.

    Raises:
        TypeError, ValueError: invalid bucket settings (see :func:`relbias.validate_t5_buckets`),
            ``num_heads`` < 1 or negative ``init_std``.
    """

    default_convention = "t5"

    def __init__(
        self,
        num_heads: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        init_std: float = 512**-0.5,
    ) -> None:
        super().__init__()
        check_int("num_heads", num_heads, minimum=1)
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std}")
        validate_t5_buckets(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
        self.num_heads = num_heads
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.weight = nn.Parameter(torch.randn(num_buckets, num_heads) * init_std)
        self.saturation_distance  # noqa: B018 - computed now, eagerly, for compiled calls later

    def index(self, offsets: torch.Tensor) -> torch.Tensor:
        """Bucket of each offset, :func:`relbias.t5_bucket` with this module's settings.

        Read from a table of the buckets of offsets ``-max_distance .. max_distance`` (built once per device;
        every larger distance is in its direction's last bucket, as ``t5_bucket`` clamps it), so a lookup is a
        clamp and a gather: O(offsets), no logarithms per call.
        """
        r = self.max_distance
        tables = self.__dict__.setdefault("_bucket_tables", {})  # device -> table (not state: rebuilt on demand)
        key = str(offsets.device)
        table = tables.get(key)
        if table is None:
            table = t5_bucket(
                torch.arange(-r, r + 1, device=offsets.device), bidirectional=self.bidirectional,
                num_buckets=self.num_buckets, max_distance=r,
            )
            if offsets.device.type != "meta":  # a meta table holds no values: rebuild it on a real device
                tables[key] = table
        return table[offsets.clamp(-r, r) + r]

    def __getstate__(self) -> dict:
        """:class:`RelativeBias`'s, less the bucket tables of :meth:`index`: they are keyed by device name, and
        ``torch.load(map_location=...)`` would move them to another device under the old key (a meta table then
        makes every lookup read uninitialised memory); rebuilt on the next call."""
        state = super().__getstate__()
        state.pop("_bucket_tables", None)
        return state

    def bucket_ranges(self) -> list[tuple[int, int | None, int | None]]:
        """Offsets per bucket, as :func:`relbias.t5_bucket_ranges`."""
        return t5_bucket_ranges(
            bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
        )

    @property
    def saturation_distance(self) -> int:
        """Smallest distance (tokens) from which every larger one shares the last bucket of its direction.

        Beyond it the bias is one constant per direction (91 bidirectional / 113 causal for 32/128). Computed once
        per setting (the bucket ranges read tensor values), so torch.compile traces a plain int.
        """
        settings = (self.bidirectional, self.num_buckets, self.max_distance)
        distance = _SATURATION.get(settings)
        if distance is None:
            with torch.device("cpu"):  # plain numbers, also when the module is built under torch.device("meta")
                _, distance, _ = self.bucket_ranges()[self.num_buckets // 2 - 1 if self.bidirectional else -1]
            _SATURATION[settings] = distance
        return distance

    def causal_mismatch(self) -> str | None:
        if not self.bidirectional:
            return None
        return (
            f"T5Bias(bidirectional=True) used with is_causal=True: past offsets get the encoder's bucketing "
            f"(half of the {self.num_buckets} buckets, the future ones, are never read); Hugging Face's T5 decoders "
            f"use causal buckets: pass bidirectional=False"
        )

    def far_constant_distance(self) -> int:
        """Distance T (tokens) from which the bias is one constant per direction: :attr:`saturation_distance`.

        Used by the structured backend: keys with ``|i - j| >= T`` all read the last bucket of their direction.
        """
        return self.saturation_distance

    def describe(self) -> dict[str, object]:
        """Constants: ``num_buckets``, ``max_distance`` (tokens) and ``saturation_distance`` (tokens)."""
        return {
            "num_buckets": self.num_buckets,
            "max_distance": self.max_distance,
            "saturation_distance": self.saturation_distance,
        }

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


register_family(
    "t5",
    lambda *, num_heads, max_len, bidirectional, **o: T5Bias(num_heads, bidirectional=bidirectional, **o),
)
