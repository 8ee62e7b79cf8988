"""The backend contract: what every attention backend declares and implements.

A backend is one module with one :class:`Backend` subclass, registered by one line in
:mod:`relbias.backends.registry`. It says which calls it cannot run, as sentences
(:meth:`Backend.unsupported_reasons`; empty: it can run), and runs the others, returning the output
and the log-sum-exp of each query's scores (:meth:`Backend.forward`). The log-sum-exp is the seam
that lets partial results merge exactly (design.md, "Log-sum-exp is the seam")::

    m = logaddexp(lse_1, lse_2);  out = out_1 * exp(lse_1 - m) + out_2 * exp(lse_2 - m)

A backend never hands a call to another one: what it cannot run is a reason, so the dispatcher (and
:func:`relbias.explain_backend`) names the backend that really runs.
"""

from __future__ import annotations

import abc
from typing import Callable

import torch

from ..call import AttentionCall

__all__ = ["Backend"]


class Backend(abc.ABC):
    """One attention backend.

    Class attributes:
        name: the name users pass as ``backend=`` (lower case, unique in the registry).
        summary: one sentence on how it computes and what it costs, shown by ``explain_backend``.
        repeatable: whether the reasons read only the call's signature (default False; every built-in backend is).

    A backend is repeatable when :meth:`unsupported_reasons` and :meth:`auto_reasons` read nothing but the call's
    shapes, dtypes, devices and options, the bias module's parameters and buffers, and
    :attr:`~relbias.call.AttentionCall.hidden_keys_finite` (or state fixed once per process, such as a build or a
    one-time check): an inference call repeated with the same signature then skips them (``relbias._repeat``).
    """

    name: str
    summary: str
    repeatable: bool = False

    @abc.abstractmethod
    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        """Why this backend cannot run ``call``: one sentence per reason; empty when it can.

        Must cost O(1) or O(parameters) in the tensors' sizes, apart from the cached
        :attr:`relbias.call.AttentionCall.hidden_keys_finite`.
        """

    def confines_non_finite(self, call: AttentionCall) -> bool:
        """Whether :meth:`forward` keeps a NaN/inf in a key or value to the queries that see it for ``call``
        (default False: a fused kernel that multiplies a hidden key's probability 0 by its value spreads it, and
        the backend's reasons refuse a call whose hidden keys hold one, see
        :attr:`~relbias.call.AttentionCall.hidden_keys_finite`). True lets the backend's reasons and a repeated
        call skip reading those keys. Reads no value; O(1)."""
        return False

    def repeat_runner(self, call: AttentionCall) -> Callable | None:
        """A function ``(query, key, value) -> (out, lse) | None`` that runs what :meth:`forward` runs for a call of
        ``call``'s signature (``relbias._repeat``) on other tensors of the same shapes, dtypes and devices, or None
        (the default: every repeat builds its call and runs :meth:`forward`). ``call`` has just run. The function
        returns None wherever it cannot vouch for these tensors (their strides, a kernel that was switched off, NaN/inf
        in keys some query cannot see that its kernel would not confine); the repeat then takes :meth:`forward`. It
        may hold values derived from the bias's state: ``relbias._repeat`` keeps it only for a ``state_only`` bias
        (or none) and calls it after checking the bias's state stamp."""
        return None

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        """Why ``backend="auto"`` passes this backend over although it could run ``call`` (default none).

        A user who names the backend still gets it; the reasons are shown by ``explain_backend``. ``auto`` asks
        these before :meth:`unsupported_reasons`, so they must be cheap and must not assume the call is supported.
        """
        return []

    def explain(self, call: AttentionCall) -> str:
        """How this backend runs ``call``, the end of the first line ``explain_backend`` gives when it does (after
        the call in words, ``relbias.backends._shared.describe.describe_call``); default :attr:`summary`."""
        return self.summary

    def notes(self, call: AttentionCall) -> list[str]:
        """Facts about this machine that bear on how this backend runs, or why it cannot run, ``call`` (how half
        precision runs on this CPU, say): sentences that ``explain_backend`` gives once, on a line of their own,
        however many of its lines they concern, and that a named backend's refusal appends. Default none; O(1)."""
        return []

    @abc.abstractmethod
    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a call that :meth:`unsupported_reasons` accepts.

        Returns:
            ``(out, lse)``. ``out``: (B, H, Lq, Dv) in the dtype of ``call.query``; 0 for a query with no visible
            key. ``lse``: (B, H, Lq) float32 (float64 for float64 inputs), the natural log-sum-exp of each query's
            scores over its visible keys (scale, bias and additive mask included); ``-inf`` for a query with no
            visible key. Both are differentiable. ``lse`` may be None when ``call.return_lse`` is False and the
            backend would compute it at extra cost.
        """

    def __repr__(self) -> str:
        return f"<relbias backend {self.name!r}>"
