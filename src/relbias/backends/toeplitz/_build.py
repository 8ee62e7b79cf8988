"""How the toeplitz kernels' extension module is obtained: an ahead-of-time module installed with the package, else
a build on first use (cached), with or without OpenMP.

1. **Ahead of time** (``RELBIAS_BUILD_NATIVE=1`` at install, :mod:`relbias.backends.toeplitz._isa`): the widest
   installed level that the CPU and ATen's capability allow, loaded when it was built from the installed sources
   (else skipped, and the build on first use runs).
2. **On first use**: :func:`torch.utils.cpp_extension.load` (a C++ compiler and the ``ninja`` package), with
   :data:`~relbias.backends.toeplitz._isa.OPT_FLAGS` (``-O3 -fno-trapping-math``) and
   :func:`~relbias.backends.toeplitz._isa.vector_flags` (x86-64: 512-bit vectors preferred), the architecture flag of
   :func:`~relbias.backends.toeplitz._isa.jit_arch_flag` and ``-fopenmp``, into
   ``$TORCH_EXTENSIONS_DIR/relbias/...`` (default ``~/.cache/relbias/torch_extensions/...``; ``$XDG_CACHE_HOME`` is
   respected), in a folder named after the torch and Python versions, a hash of the CPU's feature flags and a
   hash of the sources, their folder and the flags: a build for one CPU is never loaded on another, and each
   installed copy of the sources has its own build. The first build (:data:`BUILD_TIME`) is announced through
   :mod:`logging` before it starts; later processes load it (0.2 s).
   ``RELBIAS_NATIVE_MARCH`` skips the ahead-of-time modules and builds for the ``-march`` it names.
   ``RELBIAS_NATIVE_SANITIZE=1`` skips them too and builds with AddressSanitizer and UBSan
   (:data:`~relbias.backends.toeplitz._isa.SANITIZE_FLAGS`) into folders and a module name of its own
   (``toeplitz_native_sanitize-...``), never mixed with the normal build.
3. **No OpenMP** (Apple clang; clang without libomp): the compiler's refusal of ``-fopenmp`` is recognised, the
   kernels are built with ``-fopenmp-simd`` (vectorised, one thread per call: ``at::parallel_for`` runs serially
   without OpenMP), a ``RuntimeWarning`` says what to install, and later processes go straight to that build.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import re
import sys
import warnings
from pathlib import Path

import torch

from . import _isa as _native_isa

__all__ = ["asan_runtime_loaded", "build", "build_directory", "lacks_openmp"]

_LOG = logging.getLogger(__name__)
#: How long the first build takes, as the notice, the README and the docs say it (g++ 12.2, 2 cores: 51 s).
BUILD_TIME = "about 50 s on 2 cores"
#: The command that builds the kernels ahead of time (:mod:`relbias.cli.build`).
BUILD_COMMAND = "relbias build"


def build_notice(arch: str, threads: str, folder: Path) -> str:
    """The line logged before a build on first use starts: flags, time, folder and how to build ahead."""
    return (f"relbias: compiling the toeplitz kernels for this machine ({arch}, {threads}; {BUILD_TIME}, once) into "
            f"{folder}; `{BUILD_COMMAND}` does it ahead of time")
_NO_OPENMP_MARK = "openmp-refused"
#: What a compiler or linker prints when it has no OpenMP (GCC, clang, Apple clang; GNU ld, Apple ld).
_OPENMP_REFUSALS = re.compile(
    r"unsupported option '-fopenmp'|unrecognized command[- ]line option '-fopenmp'|omp\.h'? file not found"
    r"|omp\.h: No such file|cannot find -l(g|i)?omp\b|library not found for -l(g|i)?omp\b"
)
_NO_OPENMP_ADVICE = (
    "for multi-threaded kernels set CXX to a compiler with OpenMP (macOS: `brew install llvm`, then "
    "CXX=\"$(brew --prefix llvm)/bin/clang++\", or `brew install gcc` and CXX=g++-15; clang on Linux: "
    "`apt-get install libomp-dev`; g++ has it built in) and delete {folder}"
)


def lacks_openmp(error_text: str) -> bool:
    """Whether a failed build's message is the compiler's or linker's refusal of OpenMP."""
    return _OPENMP_REFUSALS.search(error_text) is not None


def _cpu_key() -> str:
    """A hash of what the CPU can execute: its feature flags (/proc/cpuinfo), else the platform's processor name."""
    flags = _native_isa.cpu_flags()
    text = " ".join(sorted(flags)) if flags else f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """Where builds on first use are cached: ``$TORCH_EXTENSIONS_DIR/relbias`` where set, else
    ``$XDG_CACHE_HOME/relbias/torch_extensions`` (default ``~/.cache/relbias/torch_extensions``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / "relbias"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "relbias" / "torch_extensions"


def build_directory(tag: str, kind: str = "toeplitz_native") -> Path:
    """The cache folder (under :func:`cache_root`) of a build on first use whose sources and flags hash to ``tag``,
    for this torch, Python and CPU (created); ``kind`` starts its name (``"toeplitz_native_sanitize"`` for a
    sanitizer build)."""
    name = (f"{kind}-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
            f"-cpu{_cpu_key()}-src{tag}")
    folder = cache_root() / name.replace("+", "_")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _aot_module():
    """(module, description) of the ahead-of-time module to run, or None where none is installed, none fits this
    CPU, or the one that fits does not load or was built from other sources (those two are logged)."""
    installed = [name for name, _ in _native_isa.aot_levels()
                 if importlib.util.find_spec(f"{__package__}.{_native_isa.AOT_PREFIX}{name}") is not None]
    if not installed:
        return None
    level = _native_isa.run_time_level(installed, torch.backends.cpu.get_cpu_capability(), _native_isa.cpu_flags())
    if level is None:
        return None
    try:
        module = importlib.import_module(f"{__package__}.{_native_isa.AOT_PREFIX}{level}")
    except ImportError as error:  # built against another torch (undefined symbols), or a missing library
        _LOG.warning("relbias: the ahead-of-time toeplitz kernels (%s) do not load (%s); building them for this "
                     "machine instead", level, str(error)[:300])
        return None
    if getattr(module, "source_digest", None) != _native_isa.source_digest():
        _LOG.warning("relbias: the ahead-of-time toeplitz kernels (%s) were built from other sources than the "
                     "installed ones; building them for this machine instead", level)
        return None
    return module, f"ahead-of-time build for {level}"


def _built(folder: Path, name: str) -> bool:
    return any((folder / f"{name}{suffix}").exists() for suffix in (".so", ".pyd"))


def _jit(openmp: bool, sanitize: bool = False):
    """(module, description) built on first use (or loaded from the cache), with OpenMP or with ``-fopenmp-simd``;
    ``sanitize``: with the sanitizers' flags, in folders and under a module name of their own."""
    from torch.utils import cpp_extension

    # -fopenmp: at::parallel_for is an inline template that runs serially unless compiled with OpenMP; the
    # extension's libgomp.so.1 resolves (by soname) to the one torch loaded, so it shares torch's threads and their
    # denormal mode. -fopenmp-simd keeps the kernels' `omp simd` loops vectorised without the runtime.
    arch = _native_isa.jit_arch_flag()
    opt = _native_isa.SANITIZE_FLAGS if sanitize else _native_isa.OPT_FLAGS + _native_isa.vector_flags()
    cflags = [*opt, arch, "-fopenmp" if openmp else "-fopenmp-simd"]
    ldflags = (["-fopenmp"] if openmp else []) + [f for f in opt if f.startswith("-fsanitize")]
    # the sources' folder too: ninja rebuilds when the same sources sit elsewhere (another checkout or venv), so each
    # location gets its own build (announced) rather than two of them rebuilding one folder in turn
    key = "\0".join([_native_isa.source_digest(), str(_native_isa.CSRC.resolve()), *cflags, *ldflags])
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    kind = "toeplitz_native_sanitize" if sanitize else "toeplitz_native"
    folder = build_directory(tag, kind)
    name = f"relbias_{kind}_{tag}"
    threads = ("OpenMP" if openmp else "no OpenMP: one thread per call") + (", ASan + UBSan" if sanitize else "")
    described = f"built on first use ({arch}, {threads})"
    if openmp and (folder / _NO_OPENMP_MARK).exists() and not _built(folder, name):
        if (folder / _NO_OPENMP_MARK).read_text() == os.environ.get("CXX", "c++"):
            return None  # this compiler refused OpenMP before
    if not _built(folder, name):
        _LOG.warning(build_notice(arch, threads, folder))
    try:
        module = cpp_extension.load(
            name=name, sources=[str(_native_isa.CSRC / s) for s in _native_isa.SOURCES], extra_cflags=cflags,
            extra_ldflags=ldflags, build_directory=str(folder), verbose=False,
        )
    except Exception as error:
        if openmp and lacks_openmp(str(error)):
            (folder / _NO_OPENMP_MARK).write_text(os.environ.get("CXX", "c++"))
            return None
        raise
    return module, described


#: How to run Python for a sanitizer build (docs/native-kernels.md has the details).
SANITIZE_RUN = ('LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so.6)" '
                'ASAN_OPTIONS=detect_leaks=0 python ...')


def asan_runtime_loaded() -> bool:
    """Whether AddressSanitizer's runtime is in this process (preloaded, or Python itself built with it): a sanitizer
    build loaded without it aborts the process ("ASan runtime does not come first in initial library list")."""
    import ctypes

    try:
        return hasattr(ctypes.CDLL(None), "__asan_init")
    except OSError:  # no dynamic loader to ask (not Linux / macOS)
        return False


def build():
    """(module, description): the extension with ``toeplitz_forward``, ``toeplitz_backward`` and ``has_blas``, as
    the module docstring's order finds it; raises what the build raised (no compiler, no ninja, a compile error),
    ValueError for a ``RELBIAS_NATIVE_SANITIZE`` other than unset, ``0`` or ``1``, and RuntimeError for
    ``RELBIAS_NATIVE_SANITIZE=1`` without the ASan runtime in the process (before anything is compiled)."""
    sanitize = _native_isa.sanitize_requested()
    if sanitize and not asan_runtime_loaded():
        raise RuntimeError("RELBIAS_NATIVE_SANITIZE=1 builds the kernels with AddressSanitizer, whose runtime must be "
                           f"loaded before Python starts: {SANITIZE_RUN}")
    if not sanitize and not os.environ.get("RELBIAS_NATIVE_MARCH", "").strip():
        found = _aot_module()
        if found is not None:
            return found
    found = _jit(openmp=True, sanitize=sanitize)
    if found is not None:
        return found
    found = _jit(openmp=False, sanitize=sanitize)
    warnings.warn("relbias: the toeplitz kernels were built without OpenMP (the C++ compiler refused -fopenmp), "
                  "so each call runs on one thread; " + _NO_OPENMP_ADVICE.format(folder=cache_root()), RuntimeWarning,
                  stacklevel=2)
    return found
