"""Attention backends. Each takes validated inputs and the same keyword arguments as
:func:`relbias.backends.reference.reference_attention`; :mod:`relbias.dispatch` chooses among them."""

from .blockwise import blockwise_attention
from .flex import flex_attention_backend
from .reference import reference_attention
from .structured import structured_attention

#: name -> backend function; "auto" (relbias.dispatch) picks one per call.
BACKENDS = {
    "reference": reference_attention,
    "blockwise": blockwise_attention,
    "structured": structured_attention,
    "flex": flex_attention_backend,
}

__all__ = ["BACKENDS", "blockwise_attention", "flex_attention_backend", "reference_attention", "structured_attention"]
