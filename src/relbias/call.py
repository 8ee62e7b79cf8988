"""One attention call, validated once: what every backend receives.

:func:`make_call` runs every check of :func:`relbias.attention` (types, shapes, devices, the bias, the
mask, positions, convention and scale) and returns an :class:`AttentionCall`. Backends read their
inputs from it and never re-validate; ``explain_backend`` builds the same object, so the backend it
names and the reasons it gives are those of the real call.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from . import _attention_inputs
from ._dropout import Dropout
from ._gqa import expand_kv_heads
from .biases.base import RelativeBias
from .biases.native import NativeBias
from .positions import Alignment
from .window import check_window, offset_band

__all__ = ["SIGNATURE_DERIVED", "STATE_DERIVED", "AttentionCall", "make_call"]

#: Derived values of an :class:`AttentionCall` (names in its ``_cache``) that, for the calls ``relbias._repeat``
#: keeps (inference, no mask), follow from the call's signature (shapes, dtypes, devices, options) and the bias
#: module's state stamp alone, never from a tensor's values or strides: a repeat of the signature starts with them.
#: A backend that caches such a value under a new name adds the name here.
SIGNATURE_DERIVED = ("bias_stamp", "needs_grad", "decode_native_takes")
#: Derived values that also hold the bias's values (``relbias._repeat`` keeps them for a ``state_only`` bias module
#: only, whose values read its parameters and buffers alone; another family may read anything, every call).
STATE_DERIVED = ("decode_reversed", "decode_native_arguments")


@dataclass(frozen=True, eq=False, init=False)
class AttentionCall:
    """A validated attention call (docs/conventions.md for offsets, alignment and conventions).

    Shape legend: B batch, H num_heads, Lq query_len, Lk key_len, D head_dim, Dv value head_dim.

    Attributes:
        query: (B, H, Lq, D) float tensor.
        key: (B, H, Lk, D), same dtype and device.
        value: (B, H, Lk, Dv), same dtype and device.
        bias: None, a :class:`relbias.RelativeBias` (num_heads 1 or H), or a float tensor
            broadcastable to (B, H, Lq, Lk) (logits).
        mask: None, or the mask made 4-D (leading size-1 dimensions): bool (True = may attend) or
            additive float (-inf = masked), broadcastable to (B, H, Lq, Lk).
        is_causal: hide keys with offset ``i - j < 0``. Under torch.compile with tensor positions (see
            ``alignment``) always False: the causal rule is then folded into ``mask`` (bool (B|1, 1, Lq, Lk), or
            -inf in a float mask), as deciding in Python which keys a query may see would read a position's value.
        convention: "seed", "additive" or "t5" (resolved: never None).
        scale: multiplier of ``q . k`` (resolved: 1 for "t5", default ``1 / sqrt(D)`` otherwise).
        alignment: lengths and absolute positions (tokens) of the query and key blocks; the positions are ints,
            or under torch.compile 0-dim integer tensors when they arrive as tensors
            (:func:`relbias.resolve_alignment`).
        return_lse: whether the caller reads the log-sum-exp; a backend may return None for it when
            False and computing it would cost extra.
        dropout: None, or the call's attention dropout (:class:`relbias._dropout.Dropout`: drop
            probability and the seed of its counter-based mask).
        window: None, or the local-attention window ``(left, right)`` (:mod:`relbias.window`): ints >= 0 or None
            (unbounded), at least one an int; the query at position i sees keys ``i - left <= j <= i + right``.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    bias: RelativeBias | torch.Tensor | None
    mask: torch.Tensor | None
    is_causal: bool
    convention: str
    scale: float
    alignment: Alignment
    return_lse: bool = False
    dropout: Dropout | None = None
    window: tuple[int | None, int | None] | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)  # derived values, computed once

    def __init__(self, query, key, value, bias, mask, is_causal, convention, scale, alignment, return_lse=False,
                 dropout=None, window=None):
        # one dict update instead of a frozen dataclass's object.__setattr__ per field (2.2 µs against 0.8 µs,
        # on every call: a decoding step spends about 50 µs in all)
        self.__dict__.update(query=query, key=key, value=value, bias=bias, mask=mask, is_causal=is_causal,
                             convention=convention, scale=scale, alignment=alignment, return_lse=return_lse,
                             dropout=dropout, window=window, _cache={})

    def replaced(self, **changes) -> AttentionCall:
        """A new call with ``changes`` to this one's fields (``query`` ... ``window``, as ``__init__`` takes them);
        of the derived values only the bias's state stamp carries over (the bias is the same module)."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        fields.update(changes)
        call = AttentionCall(**fields)
        call._cache["bias_stamp"] = self._cache.get("bias_stamp")
        return call

    @property
    def bias_scale(self) -> float:
        """The factor the convention applies to the bias: ``scale`` for "seed", else 1."""
        return self.scale if self.convention == "seed" else 1.0

    @property
    def delta(self) -> int | torch.Tensor:
        """``query_start - key_start`` (tokens): the offset of query 0 against key 0 (a 0-dim tensor when the
        positions are)."""
        return self.alignment.query_start - self.alignment.key_start

    @property
    def offset_band(self) -> tuple[int | None, int | None]:
        """``(lo, hi)``: the offsets ``lo <= i - j <= hi`` that the window and the causal rule leave visible (None:
        unbounded; :func:`relbias.window.offset_band`). Masks may hide more."""
        return offset_band(self.window, self.is_causal)

    @property
    def bias_module(self) -> RelativeBias | None:
        """The bias when it is a module, else None."""
        return self.bias if isinstance(self.bias, RelativeBias) else None

    @property
    def num_scores(self) -> int:
        """B·H·Lq·Lk: the number of scores a materialising backend builds."""
        b, h, lq, _ = self.query.shape
        return b * h * lq * self.alignment.key_len

    def native_bias(self):
        """``bias.native_for(alignment, query's device)`` (:class:`relbias.biases.native.NativeBias`) of an offset-only
        bias module, with the parameter state that validation took (no second look at the parameters).

        With a window, the offsets outside the window's band are evaluated at the band's nearest end instead: no
        query reads them, and a family with no value there (a per-offset table with clipping off) is not asked."""
        lo, hi = self.offset_band if self.window is not None else (None, None)
        a = self.alignment
        if (lo is None or a.min_offset >= lo) and (hi is None or a.max_offset <= hi):
            return self.bias.native_for(a, self.query.device, stamp=self._cache.get("bias_stamp"))
        return self._cached("windowed_native", lambda: NativeBias(
            self.bias.offset_values(a.offset_vector(self.query.device).clamp(min=lo, max=hi)), a))

    @property
    def needs_grad(self) -> bool:
        """Whether autograd will ask for a gradient (grad mode on, and an input or bias parameter requires it)."""
        return self._cached("needs_grad", self._needs_grad)

    def _needs_grad(self) -> bool:
        """Whether autograd will ask for a gradient: grad mode on and an input or bias parameter requires it."""
        if not torch.is_grad_enabled():
            return False
        tensors = [self.query, self.key, self.value]
        if isinstance(self.bias, RelativeBias):
            tensors += list(self.bias.parameters())
        elif isinstance(self.bias, torch.Tensor):
            tensors.append(self.bias)
        return any(t.requires_grad for t in tensors)

    @property
    def grad_source(self) -> str:
        """Why autograd will ask for a gradient, as a phrase for backend reasons: which inputs require grad, and
        that grad mode is on (``needs_grad`` must be True)."""
        which = [name for name, t in (("query", self.query), ("key", self.key), ("value", self.value)) if t.requires_grad]
        if isinstance(self.bias, RelativeBias) and any(p.requires_grad for p in self.bias.parameters()):
            which.append(f"{type(self.bias).__name__}'s parameters")
        elif isinstance(self.bias, torch.Tensor) and self.bias.requires_grad:
            which.append("the bias tensor")
        return (f"gradients are needed (grad mode is on and requires_grad is set on: {', '.join(which)}; an inference "
                f"call runs under torch.no_grad())")

    @property
    def hidden_keys_finite(self) -> bool:
        """True when no key or value that some query cannot see holds NaN/inf (see ``_hidden_keys_finite``);
        computed once per call, True without reading values under torch.compile or on the meta device."""
        return self._cached("hidden_keys_finite", self._hidden_keys_finite)

    @property
    def hides_keys(self) -> bool:
        """Whether some query may not see some key: a mask, or a key the causal rule or the window hides from some
        query (decided by the positions alone; reads no value)."""
        return self.mask is not None or self._first_hidden_key() < self.alignment.key_len

    def _first_hidden_key(self) -> int:
        """The first key (index) from which every key is hidden from some query by the causal rule or the window
        (masks aside); ``key_len`` when they hide none."""
        lk = self.alignment.key_len
        # under is_causal, keys s > delta are hidden from query 0: one slice
        first_hidden = max(0, min(lk, self.delta + 1)) if self.is_causal else lk
        if self.window is not None:  # a window that hides some key from some query: every key is read
            lo, hi = self.offset_band
            a = self.alignment
            if (lo is not None and a.min_offset < lo) or (hi is not None and a.max_offset > hi):
                first_hidden = 0
        return first_hidden

    def _hidden_keys_finite(self) -> bool:
        """True when every key and value that some query cannot see holds no NaN/inf.

        Only those matter: a fused kernel multiplies a hidden key's probability 0 by its value, so a NaN there
        would reach a query that cannot see it (0 * NaN), while a NaN that every query sees reaches exactly the
        queries that see it. Reads only the hidden keys (cached per call): none without a mask in bidirectional
        attention or when decoding with queries on the last keys; keys after the first query's position under
        ``is_causal``; every key under a window that hides some; the keys a mask hides from some query. Always True on the meta device (no values).
        """
        lq, lk = self.alignment.query_len, self.alignment.key_len
        first_hidden = self._first_hidden_key()
        if first_hidden == lk and self.mask is None:  # every query sees every key (a decoding step): nothing to read
            return True
        key, value = self.key, self.value
        if key.device.type == "meta" or torch.compiler.is_compiling():  # no values / a compiled graph: not read
            return True
        masked = None  # keys before that slice which the mask hides from some query of some (batch, head)
        if self.mask is not None and lq:
            visible = self.mask if self.mask.dtype == torch.bool else self.mask != float("-inf")
            # the query dimension reduced where it lies (1 for a key padding mask: O(Lk), never Lq x Lk)
            masked = ~visible.all(dim=2).expand(*visible.shape[:2], lk).reshape(-1, lk).all(dim=0)  # (Lk,)
            masked[first_hidden:] = False

        def finite(rows) -> bool:
            return _all_finite(key[:, :, rows]) and _all_finite(value[:, :, rows])

        if first_hidden < lk:
            # at least half the keys hidden (a causal chunk against a short cache): the whole tensors are read first,
            # without slicing (a 16 x 16 causal call: about 4 us instead of 8); only a non-finite one is read by rows
            whole_finite = 2 * first_hidden <= lk and _all_finite(key) and _all_finite(value)
            if not whole_finite and not finite(slice(first_hidden, None)):
                return False
        return masked is None or not bool(masked.any()) or finite(masked.nonzero().squeeze(1))

    @property
    def key_padding(self) -> torch.Tensor | None:
        """The (Bm, Hm, Lk) bool view of the mask when it is a key padding mask, else None (see ``_key_padding``)."""
        return self._cached("key_padding", self._key_padding)

    def _cached(self, name: str, compute):
        """A derived value, computed on first use and kept for the call (a plain dict: torch.compile traces it)."""
        cache = self._cache
        if name not in cache:
            cache[name] = compute()
        return cache[name]

    def _key_padding(self) -> torch.Tensor | None:
        """The (Bm, Hm, Lk) bool view of the mask when it is a key padding mask, else None.

        A key padding mask is bool with query dimension 1: (B or 1, H or 1, 1, Lk or 1); Bm and Hm are
        its batch and head sizes; a key dimension of 1 is expanded to Lk.
        """
        mask = self.mask
        if mask is None or mask.dtype != torch.bool or mask.shape[2] != 1:
            return None
        return mask[:, :, 0].expand(mask.shape[0], mask.shape[1], self.alignment.key_len)


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN/inf. Its sum first: a reduction that allocates nothing and is finite for any
    finite tensor short of an overflow (|sum| beyond the dtype's range); only a non-finite sum pays the exact,
    allocating ``isfinite`` scan (measured on (1, 8, 8191, 64) float32 keys: 8 ms against 26 ms and its 40 MiB of
    temporaries, on a loaded machine). The sum is read as a Python float: ``torch.isfinite`` on it and ``bool``
    cost about 8 us more per tensor on a small call (measured on (1, 8, 15, 64) float32 keys, 2-core EPYC)."""
    return math.isfinite(tensor.sum().item()) or bool(torch.isfinite(tensor).all())


def make_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    convention: str | None = None,
    query_start: int | torch.Tensor | None = None,
    key_start: int | torch.Tensor = 0,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    window: tuple[int | None, int | None] | None = None,
) -> AttentionCall:
    """Validate the arguments of :func:`relbias.attention` and build its :class:`AttentionCall`.

    Arguments as :func:`relbias.attention`.

    Warns:
        UserWarning: once per bias module, when ``is_causal=True`` meets a bidirectional bias whose
            :meth:`~relbias.RelativeBias.causal_mismatch` says why that is almost surely unintended (T5 buckets).

    Raises:
        TypeError, ValueError: as :func:`relbias.attention` documents.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if attn_mask is not None:
        if mask is not None:
            raise TypeError(
                "got both mask= and attn_mask=: attn_mask is SDPA's name for mask (bool True = may attend, float "
                "additive); pass one of them"
            )
        mask = attn_mask
    key, value = expand_kv_heads(query, key, value, enable_gqa)
    dropout = _dropout(dropout_p, generator, getattr(query, "device", None))
    window = check_window(window)
    alignment, stamp = _attention_inputs.check_call(
        query, key, value, bias=bias, mask=mask, is_causal=is_causal, query_start=query_start, key_start=key_start,
        window=window,
    )
    convention, scale = _attention_inputs.resolve_convention(convention, bias, scale, query.shape[-1])
    if is_causal and isinstance(bias, RelativeBias) and bias.bidirectional and not getattr(bias, "_mismatch_warned", False):
        note = bias.causal_mismatch()
        if note is not None:  # once per module: a training loop would repeat it every step
            bias._mismatch_warned = True
            warnings.warn(note, UserWarning, stacklevel=3)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if is_causal and isinstance(alignment.min_offset, torch.Tensor):
        mask, is_causal = _band_mask(mask, alignment, (0, None), query.device), False
    if dropout is not None:
        dropout = Dropout(dropout.p, dropout.seed, alignment.query_start, alignment.key_start)
    if window is not None and isinstance(alignment.min_offset, torch.Tensor):  # compiled static cache: as a mask
        mask, window = _band_mask(mask, alignment, offset_band(window, False), query.device), None
    call = AttentionCall(query, key, value, bias, mask, is_causal, convention, scale, alignment, return_lse, dropout,
                         window)
    call._cache["bias_stamp"] = stamp  # taken by the parameter check: the native form's memo reuses it
    return call


#: The fields ``AttentionCall.__init__`` takes, in its order.
_FIELDS = ("query", "key", "value", "bias", "mask", "is_causal", "convention", "scale", "alignment", "return_lse",
           "dropout", "window")


def _band_mask(mask: torch.Tensor | None, alignment: Alignment, band: tuple, device: torch.device) -> torch.Tensor:
    """``mask`` (4-D or None) combined with the band of offsets ``lo <= i - j <= hi`` (``band = (lo, hi)``, None
    unbounded: the causal rule is ``(0, None)``) as an explicit mask, bool (B|1, H|1, Lq, Lk) for a bool or no mask
    (True = may attend), or the float mask with -inf outside the band: for positions that are tensors (torch.compile
    with a static cache), whose key ranges cannot be planned in Python."""
    lo, hi = band
    offsets = alignment.offsets(device)
    inside = torch.ones_like(offsets, dtype=torch.bool)
    if lo is not None:
        inside = inside & (offsets >= lo)
    if hi is not None:
        inside = inside & (offsets <= hi)
    inside = inside[None, None]
    if mask is None:
        return inside
    if mask.dtype == torch.bool:
        return mask & inside
    return torch.where(inside, mask, float("-inf"))


def _dropout(dropout_p: object, generator: object, device: torch.device | None = None) -> Dropout | None:
    """Validate ``dropout_p`` / ``generator`` and draw the call's 31-bit mask seed (None when p is 0): an int read on
    the host, or under ``torch.compile`` a 0-dim int64 tensor on ``device`` (the generator's when one is given, which
    dynamo does not trace: the graph ends there; CPU by default), drawn in the graph, whose value the kernels read
    where they run (an int would end the graph)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if dropout_p == 0:
        return None
    if torch.compiler.is_compiling():
        where = generator.device if generator is not None else (device or "cpu")
        return Dropout(float(dropout_p), torch.randint(0, 2**31 - 1, (), generator=generator, device=where), 0, 0)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator, device="cpu"))  # host-side, one draw per call
    return Dropout(float(dropout_p), seed, 0, 0)
