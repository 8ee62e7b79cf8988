"""Which attention backend runs a call, and why.

``backend="auto"`` (the default): the first backend of :data:`relbias.backends.BACKENDS` (priority order)
with no unsupported reasons and no reasons for auto to pass it over. The small-block rule is one of those
reasons: the tiled backends (not toeplitz, whose one kernel call per block wins at every size) step aside for the
reference at most :data:`relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES` scores, where materialising is
cheaper. A named backend that cannot run the call raises ValueError with its reasons.
:func:`explain_backend` answers the same question without running anything; since backends never hand
a call to another one, the backend it names is the one that runs.
"""

from __future__ import annotations

import torch

from .backends import BACKENDS
from .backends._shared.describe import describe_call
from .backends.base import Backend
from .biases.base import RelativeBias
from .call import AttentionCall, make_call

__all__ = ["choose_backend", "explain_backend", "pick_backend", "resolve_backend"]


def _window_note(call: AttentionCall) -> str:
    """The window of ``call`` in words ("" without one)."""
    if call.window is None:
        return ""
    left, right = (("any number" if side is None else f"at most {side}") for side in call.window)
    return f"; window={call.window}: each query sees {left} of the keys before it and {right} after it"


def _notes(backends: list[Backend], call: AttentionCall) -> list[str]:
    """The backends' :meth:`~relbias.backends.base.Backend.notes` on ``call``, each once, in order."""
    return list(dict.fromkeys(note for backend in backends for note in backend.notes(call)))


def _reason(backend: Backend, call: AttentionCall, passed: list[tuple[Backend, str]]) -> str:
    """The pick on the first line (the call in words, then how the backend runs it), then each backend passed over
    on its own line, then each note on the machine once."""
    first = f"{backend.name}: {describe_call(call)}: {backend.explain(call)}{_window_note(call)}"
    notes = _notes([backend, *(other for other, _ in passed)], call)
    return "\n".join([first, *(f"not {other.name}: {why}" for other, why in passed), *(f"note: {n}" for n in notes)])


def _choose(call: AttentionCall) -> tuple[Backend, list[tuple[Backend, str]]]:
    """The backend "auto" runs for ``call`` and the backends before it that it passed over, with their reasons."""
    passed = []
    for backend in BACKENDS.values():
        # auto's own reasons first: they are cheap, and a backend auto passes over anyway need not run its
        # costlier checks (flex's one-time compiled probe, the scan of hidden keys)
        reasons = backend.auto_reasons(call) or backend.unsupported_reasons(call)
        if not reasons:
            return backend, passed
        passed.append((backend, "; ".join(reasons)))
    lines = [f"{backend.name}: {why}" for backend, why in passed]
    lines += [f"note: {note}" for note in _notes([backend for backend, _ in passed], call)]
    raise ValueError("no registered backend can run this call:\n" + "\n".join(lines))


def _named(name: str, call: AttentionCall) -> Backend:
    """The backend ``name`` when it can run ``call``."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {['auto', *sorted(BACKENDS)]}")
    backend = BACKENDS[name]
    reasons = backend.unsupported_reasons(call)
    if reasons:
        notes = "".join(f"; note: {note}" for note in backend.notes(call))
        raise ValueError(f"backend {name!r} cannot run this call: {'; '.join(reasons)}{notes}")
    return backend


def choose_backend(call: AttentionCall) -> tuple[Backend, str]:
    """The backend "auto" runs for ``call``, and why: ``"name: the call: how it runs"`` on the first line (with the
    window, if any), then one line ``"not other: reasons"`` for each backend before it in priority order, then one
    line ``"note: ..."`` for each fact about this machine that those lines rest on."""
    backend, passed = _choose(call)
    return backend, _reason(backend, call, passed)


def pick_backend(name: str, call: AttentionCall) -> Backend:
    """The backend that runs ``call`` for ``backend=name`` ("auto" or a registered name), as :func:`resolve_backend`
    picks it, without putting the reason into words (the path every call takes).

    Raises:
        ValueError: as :func:`resolve_backend`.
    """
    return _choose(call)[0] if name == "auto" else _named(name, call)


def resolve_backend(name: str, call: AttentionCall) -> tuple[Backend, str]:
    """``(backend, reason)`` for "auto" or a named backend (a named one's reason: its first line alone).

    Raises:
        ValueError: an unknown name, or a named backend that cannot run ``call`` (the message lists why, and the
            backend's notes on this machine).
    """
    if name == "auto":
        return choose_backend(call)
    backend = _named(name, call)
    return backend, _reason(backend, call, [])


def explain_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: RelativeBias | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    convention: str | None = None,
    query_start: int | None = None,
    key_start: int | torch.Tensor = 0,
    backend: str = "auto",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    window: tuple[int | None, int | None] | None = None,
) -> tuple[str, str]:
    """Which backend :func:`relbias.attention` would run for these arguments, and why; runs nothing.

    Takes every argument :func:`relbias.attention` takes (``query``, ``key``, ``value``, ``bias``, ``mask``,
    ``is_causal``, ``scale``, ``convention``, ``query_start``, ``key_start``, ``return_lse``, ``dropout_p``,
    ``attn_mask``, ``enable_gqa``, ``window``), with
    the same meaning, so that a training call with dropout is named as it runs.

    Args:
        backend: "auto" (default) or a name in :data:`relbias.backends.BACKENDS`.
        generator: as :func:`relbias.attention`, type-checked only: no seed is drawn from it (nor from torch's
            global RNG), so asking does not change the masks that later calls draw.

    Returns:
        (name, reason): the backend that runs the call, and why: a first line ``"name: the call: how it runs"``
        (the call in words: direction, bias, mask, dropout, forward only or forward and backward, dtype; then how
        this backend runs that call, naming the window when there is one); for "auto", then one line
        ``"not other: reasons"`` for each backend before it in priority order, which auto passed over; last, one
        line ``"note: ..."`` for each fact about this machine those lines rest on (how half precision runs here).

    Raises:
        ValueError: unknown backend, a named backend that cannot run this call (the message says why),
            or invalid inputs as :func:`relbias.attention`.
        TypeError: invalid input types, as :func:`relbias.attention`.

    Example:
        >>> import torch, relbias
        >>> q = torch.randn(1, 8, 4096, 64)
        >>> relbias.explain_backend(q, q, q, bias=relbias.T5Bias(8))[0]  # an offset-only bias, no mask
        'toeplitz'
        >>> padding = torch.ones(1, 1, 1, 4096, dtype=torch.bool)  # a key padding mask
        >>> relbias.explain_backend(q, q, q, bias=relbias.T5Bias(8), mask=padding)[0]
        'toeplitz'
        >>> additive = torch.zeros(1, 1, 1, 4096)  # an additive float mask (0 = keep, -inf = padded)
        >>> relbias.explain_backend(q, q, q, bias=relbias.T5Bias(8), mask=additive)[0]
        'blockwise'
    """
    # the seed does not steer the choice: draw it from a throwaway generator (a non-generator still raises)
    probe = torch.Generator() if isinstance(generator, torch.Generator) or generator is None else generator
    call = make_call(
        query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale, convention=convention,
        query_start=query_start, key_start=key_start, return_lse=return_lse, dropout_p=dropout_p, generator=probe,
        attn_mask=attn_mask, enable_gqa=enable_gqa, window=window,
    )
    chosen, reason = resolve_backend(backend, call)
    return chosen.name, reason
