"""Flush float denormals to zero on every CPU thread that PyTorch computes on, for the duration of a call.

Scores far below a row's maximum (a distance-decaying bias such as ALiBi's ``-m |i - j|`` over thousands of
tokens) give ``exp(s - max)`` between 2^-149 and 2^-126: float32 denormals, on which x86 arithmetic takes a
slow microcode path. Measured (2 cores, H=8, D=64): the CPU flash kernel with an ALiBi mask ran 1.4x slower
forward at 8192 tokens and 4x slower backward at 4096 than with a mask of the same size without them. Such
terms are below 2^-126 of the row's largest term (1), far under float32's resolution of the sums they enter,
so flushing them changes no result beyond rounding.

``torch.set_flush_denormal`` sets the mode (MXCSR's FTZ and DAZ bits) of the calling thread only; PyTorch's
OpenMP workers keep theirs, since they were started before. :func:`flush_denormals` therefore also runs
``torch.set_flush_denormal`` once on each thread of the OpenMP team through the runtime's ``GOMP_parallel``
entry point (libgomp; LLVM's and Intel's runtimes export it too), found among the loaded libraries. Where none
is found, only the calling thread is set (results are the same, only slower).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import torch

__all__ = ["flush_denormals", "flush_denormals_for"]

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _set_this_thread(data) -> None:
    """Run on each thread of the team: ``data`` is the mode, passed per call (NULL: off), so concurrent calls
    from several Python threads, each with its own OpenMP team, cannot read each other's."""
    torch.set_flush_denormal(bool(data))


_ON_EACH_THREAD = _CALLBACK(_set_this_thread)


@functools.lru_cache(maxsize=1)
def _gomp_parallel():
    """The loaded OpenMP runtime's ``GOMP_parallel(fn, data, num_threads, flags)``, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).GOMP_parallel
        except (OSError, AttributeError):
            continue
        function.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        function.restype = None
        return function
    return None


def _set_every_thread(on: bool) -> bool:
    """Set the flush mode of this thread and of each OpenMP worker; False where the CPU cannot flush."""
    if not torch.set_flush_denormal(on):
        return False
    parallel = _gomp_parallel()
    if parallel is not None and torch.get_num_threads() > 1:
        parallel(_ON_EACH_THREAD, ctypes.c_void_p(1) if on else None, torch.get_num_threads(), 0)
    return True


def _flushing() -> bool:
    """Whether this thread flushes denormals now (one float32 denormal multiply)."""
    return bool(torch.tensor(1e-40, dtype=torch.float32).mul(1.0) == 0)


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush denormals to zero on CPU for the duration of the block, on every thread; then turn it off again.

    Nothing changes when the calling thread flushes already (the user's setting is kept) or when the CPU
    cannot flush. The mode is process-wide while it lasts: other Python threads computing at the same time
    flush too.
    """
    if _flushing() or not _set_every_thread(True):
        yield
        return
    try:
        yield
    finally:
        _set_every_thread(False)


def flush_denormals_for(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """:func:`flush_denormals` for a computation on ``tensor``'s device: a no-op off the CPU and while
    torch.compile traces (a compiled graph cannot call into the OpenMP runtime)."""
    if tensor.device.type != "cpu" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return flush_denormals()
