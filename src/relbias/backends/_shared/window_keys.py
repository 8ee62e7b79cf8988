"""A windowed call narrowed to the keys its queries can see: the decode backend reads only those (a decoding step
with a window of W reads W keys of any cache), and a context-parallel block wholly outside the window is skipped."""

from __future__ import annotations

import dataclasses

from ...call import AttentionCall
from ...positions import Alignment
from ...window import key_range

__all__ = ["narrow_to_window"]


def narrow_to_window(call: AttentionCall) -> AttentionCall:
    """``call`` with key, value and mask cut to the keys ``[begin, end)`` that some query's window reaches
    (:func:`relbias.window.key_range`), positions kept absolute (the first key's position moves to ``begin``), so
    every offset, bias value and dropout bit is the one of the whole call; ``call`` itself without a window, or when
    every key is in reach. The result may have no keys (``key_len`` 0): then no query sees any. Int positions only.
    """
    if call.window is None:
        return call
    a = call.alignment
    delta = a.query_start - a.key_start
    begin, end = key_range(call.offset_band, delta, delta + a.query_len - 1, a.key_len)
    end = max(begin, end)
    if begin == 0 and end == a.key_len:
        return call
    mask = call.mask
    if mask is not None and mask.shape[-1] != 1:
        mask = mask[..., begin:end]
    dropout = call.dropout
    if dropout is not None:  # the same bits at the same absolute positions
        dropout = dataclasses.replace(dropout, key_start=dropout.key_start + begin)
    return call.replaced(key=call.key[:, :, begin:end], value=call.value[:, :, begin:end], mask=mask,
                         alignment=Alignment(a.query_len, end - begin, a.query_start, a.key_start + begin),
                         dropout=dropout)
