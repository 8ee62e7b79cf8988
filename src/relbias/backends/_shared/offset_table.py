"""The bias of every decoding step from one table: the scaled per-offset values, reversed, over a range of offsets
that grows geometrically with the keys.

A decoding step at position p reads offsets 0 .. p (one query) or a few more for a chunk of queries; the next step
reads one offset more. Computing each step's values anew (Hugging Face's T5 ``compute_bias``; relbias' native
form, memoised per block) costs a bucketing, a gather and a flip per step. The table holds, for one bias module,
dtype, scale and device, the reversed values ``table[:, m]`` = ``scale * bias(C - 1 - m)`` for offsets ``C - 1``
down to ``-SPAN`` (``-inf`` at the negative, future offsets), with a capacity ``C`` doubled when a step needs
more; a step's ``w`` (Hb, Lq + Lk - 1), the reversed bias that the toeplitz kernel and the decode rows read, is then
a view into it: no computation until the keys outgrow ``C``.

The table is rebuilt when the bias's parameters or buffers change (their state stamp: identity, storage or version
counter, as the native form's memo) and is kept outside the module (a weak reference to it), so that copies and
pickles of a model carry no cache. Only families whose values read their parameters and buffers alone
(``state_only``: T5, per-offset, ALiBi, KERPLE) have one.
"""

from __future__ import annotations

import weakref

import torch

from ...biases.base import RelativeBias
from ...call import AttentionCall

__all__ = ["SPAN", "MIN_CAPACITY", "reversed_rows"]

#: Future offsets (tokens) the table covers, all ``-inf``: a causal chunk of up to ``SPAN + 1`` queries.
SPAN = 15
#: Smallest capacity C (offsets 0 .. C - 1).
MIN_CAPACITY = 256

#: bias module -> [key, capacity, table, limit, last view]
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reversed_rows(call: AttentionCall, dtype: torch.dtype) -> torch.Tensor | None:
    """``w`` (Hb, Lq + Lk - 1) in ``dtype`` for ``call``: ``w[:, m]`` the scaled bias at offset ``max_offset - m``,
    ``-inf`` at negative offsets (the causal rule's future keys), a view into the bias's table with unit stride along
    offsets; or None where no table serves the call: a bias that is not a ``state_only`` offset-only module, tensor
    positions (torch.compile), a call that needs gradients, offsets below ``-SPAN`` or a non-causal
    call that reads negative offsets, or offsets the family does not define."""
    bias, a = call.bias, call.alignment
    if not isinstance(bias, RelativeBias) or not (bias.offset_only and bias.state_only) or call.needs_grad:
        return None
    low, high = a.min_offset, a.max_offset
    if isinstance(low, torch.Tensor) or low < (-SPAN if call.is_causal else 0) or torch.compiler.is_compiling():
        return None
    stamp = call._cache.get("bias_stamp") or bias.state_stamp()
    key = (dtype, call.bias_scale, call.query.device, torch.is_inference_mode_enabled(), stamp)
    entry = _TABLES.get(bias)
    if entry is None or entry[0] != key or entry[1] <= high:
        capacity, limit = max(MIN_CAPACITY, 1 << int(high).bit_length()), _defined_up_to(bias)
        table = _table(bias, capacity, limit, dtype, call.bias_scale, call.query.device)
        entry = _TABLES[bias] = [key, capacity, table, limit, None]
    _, capacity, table, limit, last = entry
    if limit is not None and high > limit:
        return None  # offsets the family has no value for: the caller's path raises the family's error
    if last is None or last[0] != (low, high):  # the layers of one decoding step share their view
        last = entry[4] = ((low, high), table.narrow(1, capacity - 1 - high, high - low + 1))
    return last[1]


def _defined_up_to(bias: RelativeBias) -> int | None:
    """The largest offset the family has a value for, or None (every offset): a per-offset table without
    clipping stops at ``max_table_offset``."""
    if bias.far_constant_distance() is not None:
        return None
    return getattr(bias, "max_table_offset", None)


def _table(bias: RelativeBias, capacity: int, limit: int | None, dtype: torch.dtype, scale: float,
           device: torch.device) -> torch.Tensor:
    """(Hb, capacity + SPAN): the scaled values at offsets ``capacity - 1`` down to 0, then ``SPAN`` columns of
    ``-inf``. Offsets past a far-constant family's distance T or past ``limit`` (:func:`_defined_up_to`: a per-offset
    table's end) are not evaluated: the former repeat offset T's value, the latter are never read
    (:func:`reversed_rows` refuses them)."""
    far = bias.far_constant_distance()
    bound = far if far is not None else limit  # at most one of them is set (_defined_up_to)
    top = capacity - 1 if bound is None else min(capacity - 1, bound)
    with torch.no_grad():
        values = bias.offset_values(torch.arange(top + 1, device=device)).to(dtype) * scale  # (Hb, top + 1), ascending
        table = values.new_full((values.shape[0], capacity + SPAN), float("-inf"))
        table[:, capacity - 1 - top: capacity] = values.flip(-1)
        if far is not None and top < capacity - 1:
            table[:, : capacity - 1 - top] = values[:, top: top + 1]  # offsets beyond T: the value at T
    return table
