"""The backends in priority order: ``backend="auto"`` takes the first that can run a call.

Adding a backend is one module with a :class:`relbias.backends.base.Backend` subclass and one line in
:data:`_PRIORITY` below (or a call to :func:`register_backend` from user code).
"""

from __future__ import annotations

from .base import Backend
from .blockwise import BlockwiseBackend
from .decode import DecodeBackend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .structured import StructuredBackend
from .toeplitz import ToeplitzBackend
from .triton import TritonBackend

__all__ = ["BACKENDS", "generation", "register_backend", "unregister_backend"]

#: name -> backend, in priority order (dicts keep insertion order).
BACKENDS: dict[str, Backend] = {}

_generation = [0]  # changes with every registration and removal


def generation() -> int:
    """A number that changes whenever :data:`BACKENDS` does (through :func:`register_backend` or
    :func:`unregister_backend`): what was decided against the registry holds while it is unchanged."""
    return _generation[0]


def register_backend(backend: Backend, *, before: str | None = None) -> None:
    """Add ``backend`` to :data:`BACKENDS`, last or just before the backend named ``before``.

    Raises:
        TypeError: ``backend`` is not a :class:`Backend` instance, or lacks a str ``name`` / ``summary``.
        ValueError: its name is "auto", already registered, or ``before`` is not registered.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend must be an instance of relbias.backends.Backend, got {type(backend).__name__}")
    for attribute in ("name", "summary"):
        if not isinstance(getattr(backend, attribute, None), str):
            raise TypeError(
                f"{type(backend).__name__} needs a class attribute {attribute!r} (a str): 'name' is what users pass as "
                f"backend=, 'summary' the sentence explain_backend shows"
            )
    name = backend.name
    if not isinstance(name, str) or not name or name == "auto" or name in BACKENDS:
        raise ValueError(f"backend name {name!r} is reserved or already registered; registered: {list(BACKENDS)}")
    if before is not None and before not in BACKENDS:
        raise ValueError(f"cannot insert before {before!r}: registered backends are {list(BACKENDS)}")
    items = list(BACKENDS.items())
    at = len(items) if before is None else [n for n, _ in items].index(before)
    items.insert(at, (name, backend))
    BACKENDS.clear()
    BACKENDS.update(items)
    _generation[0] += 1


def unregister_backend(name: str) -> Backend:
    """Remove and return the backend named ``name``.

    Raises:
        ValueError: ``name`` is not registered.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; registered: {list(BACKENDS)}")
    _generation[0] += 1
    return BACKENDS.pop(name)


_PRIORITY = (
    DecodeBackend(),  # few queries: the bias rows as one fused kernel's additive mask (CPU, inference)
    TritonBackend(),  # offset-only biases on CUDA: fused Triton kernels, forward and backward, after a one-time check
    FlexBackend(),  # fused with the bias in score_mod; auto takes it on CUDA for inference
    ToeplitzBackend(),  # offset-only biases: a strided view of the per-offset values as the fused kernel's mask
    StructuredBackend(),  # far-constant biases: bias-free fused far parts + a tiled band
    BlockwiseBackend(),  # every bias module and mask, any device
    ReferenceBackend(),  # everything, materialised
)
for _backend in _PRIORITY:
    register_backend(_backend)
