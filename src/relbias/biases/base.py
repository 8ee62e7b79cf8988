"""The contract every relative position bias keeps.

A bias is a function of the offset ``i - j`` (query position minus key position, tokens) and of the
head. Each family implements one method, :meth:`RelativeBias.offset_values`; the contract derives the
two forms from it:

* the native form, :meth:`RelativeBias.native`: one value per head and per distinct offset of a
  (query, key) block, shape (H, Lq + Lk - 1). Backends look values up in it instead of materialising
  (H, Lq, Lk);
* the materialised form, :meth:`RelativeBias.forward`: shape (H, Lq, Lk).

The contract also gives every family, with one implementation each: the distance rule
(:meth:`RelativeBias.distance`), which pairs share a parameter (:meth:`RelativeBias.parameter_key`,
:meth:`RelativeBias.pairs_sharing`), the count of learnable scalars
(:attr:`RelativeBias.num_parameters`), the family's constants (:meth:`RelativeBias.describe`, what
``relbias inspect`` prints) and the far-constant distance (:meth:`RelativeBias.far_constant_distance`).

Families backed by a learnable table (per-offset, T5 buckets) derive from
:class:`relbias.biases.table.TableBias`. A family registers itself by name in its own module
(:func:`relbias.biases.registry.register_family`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..positions import Alignment, resolve_alignment
from .native import NativeBias

__all__ = ["CONVENTIONS", "RelativeBias", "StateStamp"]


#: Attributes whose setting does not change a bias's values (the module's mode; a warning given once).
_UNTRACKED_SETTINGS = frozenset({"training", "_mismatch_warned"})


class StateStamp(list):
    """A bias module's :meth:`RelativeBias.state_stamp`: how many times its settings were set, then ``(id, data_ptr,
    version counter, dtype)`` of each parameter and buffer, compared as a list. It also holds the tensors
    (``tensors``, not compared), so while a cache keeps a stamp no other tensor can take a stamped tensor's id and
    storage: a parameter replaced, even twice (the second one allocated where the first original was), never matches
    the stamp of the original."""

    __slots__ = ("tensors",)

#: Score conventions (docs/conventions.md): "seed" ``((q.k) + PE) * scale``; "additive" ``(q.k) * scale + PE``;
#: "t5" ``(q.k) + PE`` (no scaling). A mask is added after all three.
CONVENTIONS = ("seed", "additive", "t5")


class RelativeBias(nn.Module):
    """Base class of relative position biases: ``PE(i, j) = f_h(i - j)``.

    Subclasses set ``num_heads`` (H of the output; 1 means one bias shared by every head, which
    broadcasts), ``bidirectional`` (False: defined for past keys only, offset >= 0; future keys must be
    masked) and ``default_convention`` (one of :data:`relbias.CONVENTIONS`, used by
    :func:`relbias.attention` when no convention is given), and implement :meth:`offset_values`.
    Everything else has a default: a new family is one class plus one
    :func:`relbias.biases.register_family` call, in one file.
    """

    num_heads: int
    bidirectional: bool
    default_convention: str = "seed"
    #: True when the bias depends on the offset i - j alone. A family that also reads the absolute
    #: query position (FIRE normalises by it) sets False, overrides :meth:`relbias.RelativeBias.pair_values`, and has no
    #: per-offset native form.
    offset_only: bool = True
    #: True when the bias is a function of :meth:`relbias.RelativeBias.distance` alone (ALiBi, KERPLE): pairs at
    #: the same distance read the same value, which :meth:`relbias.RelativeBias.parameter_key` then reports.
    distance_only: bool = False
    #: True when :meth:`relbias.RelativeBias.offset_values` reads nothing but the module's parameters and buffers,
    #: so :meth:`relbias.RelativeBias.native` may reuse its last result while they are unchanged (inference: a
    #: decoder's layers share one bias per step). False by default: a subclass (or :class:`FunctionBias`' user
    #: function) may read other state.
    state_only: bool = False

    def __setattr__(self, name: str, value) -> None:
        """As ``nn.Module``'s; setting a plain attribute (a family's setting such as ``max_distance`` or
        ``out_of_range``; not a tensor, a submodule or ``training``) also counts as a change of the module's state:
        :meth:`state_stamp` differs afterwards, so nothing derived under the earlier settings (a repeated call's
        checks, the native form's memo, the offset table) is reused."""
        super().__setattr__(name, value)
        if name not in _UNTRACKED_SETTINGS and not isinstance(value, (torch.Tensor, nn.Module)):
            self.__dict__["_settings_version"] = self.__dict__.get("_settings_version", 0) + 1

    def offset_values(self, offsets: torch.Tensor) -> torch.Tensor:
        """Bias values at the given offsets.

        Args:
            offsets: int64 tensor of any shape S, offsets ``i - j`` in tokens.

        Returns:
            float tensor ``(H, *S)``, logits.

        Raises:
            ValueError: an offset the family cannot evaluate (e.g. beyond a per-offset table).
        """
        raise NotImplementedError

    def pair_values(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Bias of every (query, key) pair of a tile, from absolute positions.

        Args:
            query_positions: int64 (Tq,), absolute query positions in tokens.
            key_positions: int64 (Tk,), absolute key positions in tokens.

        Returns:
            float tensor (H, Tq, Tk), logits. The default evaluates :meth:`offset_values` at
            ``query_positions[:, None] - key_positions[None, :]``; families with ``offset_only = False``
            override it. Backends call this for tiles of biases that are not offset-only.
        """
        return self.offset_values(query_positions[:, None] - key_positions[None, :])

    def distance(self, offsets: torch.Tensor) -> torch.Tensor:
        """The distance a distance-based family penalises, per offset: int64 tensor, same shape, tokens.

        ``|i - j|`` when ``bidirectional``; causal: ``max(i - j, 0)``, so future keys (offset < 0) get
        distance 0 (and the family's value at 0; they are masked). Used by ALiBi, KERPLE and FIRE.

        Args:
            offsets: int64 tensor of any shape, offsets ``i - j`` in tokens.
        """
        return offsets.abs() if self.bidirectional else offsets.clamp(min=0)

    def parameter_key(self, offsets: torch.Tensor) -> torch.Tensor:
        """Identifier of the parameter (or function value) each offset reads: int64, same shape.

        Two (query, key) pairs share a parameter exactly when their keys are equal. The default is the
        offset itself (a general function of the offset), or ``|offset|`` for a bidirectional
        ``distance_only`` family (a key d tokens before the query reads what one d tokens after does);
        table families return the table row (:meth:`relbias.TableBias.index`).
        """
        return offsets.abs() if self.distance_only and self.bidirectional else offsets

    @property
    def num_parameters(self) -> int:
        """Number of learnable scalars: the total ``numel`` of the module's parameters, each counted once.

        Frozen parameters (``requires_grad=False``) count too, so the number describes the family and its
        settings rather than a training setup; buffers (e.g. ALiBi's slopes) do not. T5: num_buckets * H;
        per-offset: rows * H; KERPLE: 2 H; ALiBi: 0.
        """
        return sum(p.numel() for p in self.parameters())

    def describe(self) -> dict[str, object]:
        """The family's own constants, human-readable and JSON-ready; what ``relbias inspect`` prints.

        Keys name a constructor setting or a derived constant (e.g. T5 ``num_buckets``, ALiBi ``slopes``);
        values are ints, floats, bools, strings, None, or lists of floats (one per head). Learnable
        constants are reported at their current values. The attributes every bias has (``num_heads``,
        ``bidirectional``, ``default_convention``, ``offset_only``, :attr:`num_parameters`) are not
        repeated. The default is ``{}``.
        """
        return {}

    def causal_mismatch(self) -> str | None:
        """Why using this (bidirectional) bias under ``is_causal=True`` is almost surely a mistake, or None.

        Families whose bidirectional form equals their causal form on past keys (ALiBi, KERPLE, FIRE,
        functions of the offset) return None (the default); table families whose causal form is laid out
        differently (T5 buckets, per-offset rows) say what the user would lose. :func:`relbias.attention`
        warns with it once per module.
        """
        return None

    def far_constant_distance(self) -> int | None:
        """The distance T (tokens, >= 1) from which the bias is one constant per direction, or None.

        When not None, every offset ``>= T`` has the value of offset ``T`` and (bidirectional) every
        offset ``<= -T`` that of ``-T``, per head: the structured backend and context-parallel attention
        then treat far key blocks as bias-free attention plus a constant. The default is None.
        """
        return None

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """The module's parameters, then its buffers (submodules' included), as ``parameters()`` and ``buffers()``
        list them; without submodules (every built-in family) read directly, a few µs cheaper per call."""
        if not self._modules:
            return tuple([t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None])
        return (*self.parameters(), *self.buffers())

    def state_stamp(self, tensors: tuple[torch.Tensor, ...] | None = None) -> list:
        """What identifies the current values of :meth:`state_tensors` (``tensors``, when the caller has them): each
        tensor's identity, storage, autograd version counter and dtype, and the count of the module's settings
        (a ``StateStamp``: a list that also holds the tensors). It changes when a parameter or buffer is written in
        place (an autograd-visible write), replaced or cast, and when a setting is assigned (``__setattr__``);
        O(number of tensors), no value read. Writes through ``.data`` bypass the version counter and are not seen."""
        if tensors is None and not self._modules:  # every built-in family: read directly (a repeated call's check)
            groups = (self._parameters.values(), self._buffers.values())
        else:
            groups = (self.state_tensors() if tensors is None else tensors,)
        stamp, held = StateStamp(), []
        stamp.append(self.__dict__.get("_settings_version", 0))
        for group in groups:  # plain loops: cheaper than comprehensions of tuples
            for t in group:
                if t is not None:
                    stamp.append((id(t), t.data_ptr(), t._version, t.dtype))
                    held.append(t)
        stamp.tensors = held
        return stamp

    def _device(self, tensors: tuple[torch.Tensor, ...] | None = None) -> torch.device:
        """The device of the first of :meth:`state_tensors` (``tensors``, when the caller has them), else CPU."""
        for tensor in self.state_tensors() if tensors is None else tensors:
            return tensor.device
        return torch.device("cpu")

    def native(
        self,
        query_len: int,
        key_len: int,
        *,
        query_start: int | None = None,
        key_start: int = 0,
        device: torch.device | str | None = None,
    ) -> NativeBias:
        """Native form for a block: values (H, Lq + Lk - 1) over the block's offsets, ascending.

        Args:
            query_len, key_len: lengths in tokens.
            query_start: position of the first query; default aligns queries to the last keys.
            key_start: position of the first key; default 0.
            device: device of the values; default the module's.

        Returns:
            :class:`NativeBias`. For a :attr:`state_only` family outside autograd, the last result is returned again
            while the block, device, parameters and buffers are unchanged: callers must not modify its values.

        Raises:
            TypeError, ValueError: bad lengths or positions, or offsets the family cannot evaluate.
            NotImplementedError: the family is not offset-only (``offset_only = False``).
        """
        alignment = resolve_alignment(query_len, key_len, query_start=query_start, key_start=key_start)
        return self.native_for(alignment, device)

    def native_for(self, alignment: Alignment, device: torch.device | str | None = None, *,
                   stamp: list[tuple] | None = None) -> NativeBias:
        """:meth:`native` for an :class:`relbias.Alignment` already resolved (a backend holds its call's): the same
        result, without validating the lengths and positions again. ``stamp``: :meth:`state_stamp` when the caller
        took it for this call (an :class:`relbias.call.AttentionCall` holds its own), else taken here. Errors:
        those of :meth:`offset_values`, and NotImplementedError for a family that is not offset-only."""
        if not self.offset_only:
            raise NotImplementedError(
                f"{type(self).__name__} depends on absolute positions, not on i - j alone, so it has no "
                f"per-offset native form; use pair_values() or forward()"
            )
        device = self._device() if device is None else device
        memo = self._memo_key(alignment, device, stamp)
        if memo is not None and self.__dict__.get("_native_memo", (None,))[0] == memo:
            return self.__dict__["_native_memo"][1]
        native = NativeBias(self.offset_values(alignment.offset_vector(device)), alignment)
        if memo is not None:
            self.__dict__["_native_memo"] = (memo, native)
        return native

    def __getstate__(self) -> dict:
        """The module's state for ``copy.deepcopy``, pickling and ``torch.save``: that of any module, less what is
        only valid for this object in this process, rebuilt or redone on the next call: the memo of the last native
        form, and the state stamp of the parameters last found finite."""
        state = super().__getstate__()
        state.pop("_native_memo", None)
        state.pop("_finite_stamp", None)
        return state

    def _memo_key(self, alignment, device, stamp=None) -> tuple | None:
        """What :meth:`native`'s last result is valid for, or None where it must not be reused: families not
        :attr:`state_only`, calls whose values need a graph (grad mode with a parameter requiring grad), tensor
        positions and compiled calls. The key holds the alignment, the device, inference mode (an inference
        tensor cannot enter autograd later) and the module's :meth:`state_stamp`."""
        if not self.state_only or torch.compiler.is_compiling() or isinstance(alignment.min_offset, torch.Tensor):
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in self.state_tensors()):
            return None
        stamp = self.state_stamp() if stamp is None else stamp
        device = device if isinstance(device, torch.device) else torch.device(device)
        return alignment, device, torch.is_inference_mode_enabled(), stamp

    def forward(
        self, query_len: int, key_len: int, *, query_start: int | None = None, key_start: int = 0
    ) -> torch.Tensor:
        """Materialised bias: float tensor (H, Lq, Lk); entry (h, t, s) = f_h(query pos t - key pos s).

        Arguments and errors as :meth:`native`.
        """
        if self.offset_only:
            return self.native(query_len, key_len, query_start=query_start, key_start=key_start).materialize()
        a = resolve_alignment(query_len, key_len, query_start=query_start, key_start=key_start)
        device = self._device()
        return self.pair_values(
            torch.arange(a.query_start, a.query_start + a.query_len, device=device),
            torch.arange(a.key_start, a.key_start + a.key_len, device=device),
        )

    def pairs_sharing(self, query: int, key: int, length: int) -> torch.Tensor:
        """Every (query, key) pair of a ``length``-token sequence that shares the parameter of ``(query, key)``.

        Positions are 0-based token indices. A causal bias (``bidirectional=False``) counts only
        pairs with key <= query (the others are masked).

        Returns:
            int64 tensor (n, 2) of ``[query, key]`` rows, sorted by query then key.

        Raises:
            ValueError: a position outside ``[0, length)``, or a future key for a causal bias.

        Example:
            For a per-offset bias, (8, 3) has offset 5 and shares its scalar with (5, 0), (6, 1), ...
        """
        for name, value in (("query", query), ("key", key)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < length:
                raise ValueError(f"{name} must be a position in [0, {length}), got {value!r}")
        if not self.bidirectional and key > query:
            raise ValueError(f"key {key} is after query {query}: a causal bias has no parameter for future keys")
        offsets = resolve_alignment(length, length, query_start=0).offsets(self._device())
        keys = self.parameter_key(offsets)
        same = keys == keys[query, key]
        if not self.bidirectional:
            same &= offsets >= 0
        return same.nonzero()
