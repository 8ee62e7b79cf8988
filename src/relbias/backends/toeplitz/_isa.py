"""What the toeplitz kernels are compiled for: the C++ sources, their digest, the ``-march`` of a build on first use,
and the instruction-set levels of an ahead-of-time build with the rule that picks one at run time.

Imports nothing outside the standard library, so that ``setup.py`` reads the same lists (it loads this file by path,
before torch or relbias are importable).

- **Build on first use** (the default): :data:`OPT_FLAGS`, :func:`vector_flags` and ``-march=native`` on x86
  (``-mcpu=native`` on Arm), or ``-march=VALUE`` where the environment sets ``RELBIAS_NATIVE_MARCH=VALUE`` (e.g.
  ``x86-64-v2`` for a portable baseline).
- **Sanitizer build** (``RELBIAS_NATIVE_SANITIZE=1``, :func:`sanitize_requested`): built on first use with
  :data:`SANITIZE_FLAGS` in place of :data:`OPT_FLAGS`, for tests under AddressSanitizer and UBSan.
- **Ahead of time** (``RELBIAS_BUILD_NATIVE=1`` at install): one extension module per level of :func:`aot_levels`
  (x86-64-v2, -v3 = AVX2 + FMA, -v4 = AVX-512, as defined by the x86-64 psABI; one ``armv8-a`` build on Arm), and
  :func:`run_time_level` takes the widest the CPU executes, capped by ATen's own choice
  (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` lowers), as ATen dispatches its CPU
  kernels.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
#: Compiled into the one module (toeplitz_backward.cpp defines the Python bindings of both kernels and calls
#: toeplitz_repeat.cpp's for ``ForwardRepeat``, a repeated decoding call's forward).
SOURCES = ("toeplitz_backward.cpp", "toeplitz_forward.cpp", "toeplitz_repeat.cpp")
#: Included by the sources: hashed with them, shipped with them.
HEADERS = ("toeplitz_common.h", "toeplitz_packed.h")
#: Name of an ahead-of-time module: ``relbias.backends.toeplitz._native_<level>``.
AOT_PREFIX = "_native_"
#: Optimisation flags of every build (on first use and ahead of time), before the architecture flag.
#: ``-fno-trapping-math`` (as libtorch itself is compiled): GCC's default assumes floating-point operations may trap,
#: and then does not if-convert the clamps and selects of the kernels' row passes (the exponential's range clamp, a
#: causal or padded key's zero) on targets without AVX-512's masked instructions, leaving those loops scalar: 5-7x
#: slower per score on x86-64-v3 (AVX2) and v2. Results do not change (no reassociation, no contraction beyond the
#: default's).
OPT_FLAGS = ("-O3", "-fno-trapping-math")


def vector_flags(machine: str | None = None) -> tuple[str, ...]:
    """Flags of every optimised build for ``machine`` (default: this one's) after :data:`OPT_FLAGS`: on x86-64
    ``-mprefer-vector-width=512``, so that a target with AVX-512 (a build on first use with ``-march=native``, the
    ahead-of-time x86-64-v4 module) runs the row passes' loops in 512-bit registers, as ATen's own AVX-512 kernels
    do, where GCC's tuning for the CPU would take 256 (no effect on targets without AVX-512); none elsewhere. Results
    do not change (the reductions' order is fixed by the sources). Measured on a 2-core Intel Xeon with AVX-512
    (docs/native-kernels.md): the forward of a 16 x 16 decoding chunk 15 -> 12.5 us, of 16 x 128 46 -> 40.5."""
    return ("-mprefer-vector-width=512",) if (machine or platform.machine()).lower() in ("x86_64", "amd64") else ()

# /proc/cpuinfo flags each x86-64 level needs beyond the previous one (x86-64 psABI, "micro-architecture levels").
_X86_LEVELS = (
    ("x86_64_v2", "x86-64-v2", ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")),
    ("x86_64_v3", "x86-64-v3", ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")),
    ("x86_64_v4", "x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
)
#: ATen's CPU capability -> the widest level it allows.
_ATEN_CAP = {"DEFAULT": "x86_64_v2", "AVX2": "x86_64_v3", "AVX512": "x86_64_v4"}


def is_arm(machine: str | None = None) -> bool:
    """Whether ``machine`` (default: this one's ``platform.machine()``) is a 64-bit Arm CPU."""
    return (machine or platform.machine()).lower() in ("aarch64", "arm64")


def aot_levels(machine: str | None = None) -> tuple[tuple[str, str], ...]:
    """(level name, ``-march`` value) of each ahead-of-time build for ``machine``, narrowest first: the three
    x86-64 levels on x86, ``armv8-a`` on Arm, none elsewhere."""
    if is_arm(machine):
        return (("armv8", "armv8-a"),)
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        return tuple((name, march) for name, march, _ in _X86_LEVELS)
    return ()


def jit_arch_flag(environ=os.environ, machine: str | None = None) -> str:
    """The architecture flag of a build on first use: ``-march=$RELBIAS_NATIVE_MARCH`` where set, else
    ``-mcpu=native`` on Arm (GCC and clang both take it there; Apple clang refuses ``-march=native``), else
    ``-march=native``.

    Raises ValueError for a ``RELBIAS_NATIVE_MARCH`` that holds anything but one word of letters, digits, ``.``,
    ``_``, ``+`` and ``-``."""
    value = environ.get("RELBIAS_NATIVE_MARCH", "").strip()
    if value:
        if not all(c.isalnum() or c in "._+-" for c in value):
            raise ValueError(f"RELBIAS_NATIVE_MARCH must be one -march value such as x86-64-v2, got {value!r}")
        return f"-march={value}"
    return "-mcpu=native" if is_arm(machine) else "-march=native"


#: Flags a sanitizer build (``RELBIAS_NATIVE_SANITIZE=1``) compiles and links with, after the architecture flag:
#: AddressSanitizer and UndefinedBehaviorSanitizer, UBSan's first report aborting like ASan's (no recovery), frame
#: pointers and debug lines for the reports' stack traces (inlined frames included). ``-O1`` in place of
#: :data:`OPT_FLAGS`' ``-O3``: the level ASan's documentation suggests; GCC auto-vectorises no loops there, so a
#: report names the one element read or written, and the tests still run at about half the normal build's speed.
SANITIZE_FLAGS = ("-O1", "-g", "-fno-trapping-math", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                  "-fno-sanitize-recover=undefined")


def sanitize_requested(environ=os.environ) -> bool:
    """Whether ``RELBIAS_NATIVE_SANITIZE`` asks for a sanitizer build: ``"1"`` yes; unset, ``""`` or ``"0"`` no
    (default). A sanitizer build is built on first use with :data:`SANITIZE_FLAGS` into a cache folder of its own
    and needs the ASan runtime preloaded (docs/native-kernels.md).

    Raises ValueError, naming the value, for anything else."""
    value = environ.get("RELBIAS_NATIVE_SANITIZE", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"RELBIAS_NATIVE_SANITIZE must be 1 (a sanitizer build) or 0 / unset (none), got {value!r}")
    return value == "1"


def source_digest() -> str:
    """A 16-hex-digit SHA-256 of every source and header (names and bytes): what a built module is checked
    against before it is loaded."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags (the ``flags`` line on x86, ``Features`` on Arm) or None where ``path`` cannot be
    read (not Linux)."""
    try:
        with open(path) as info:
            for line in info:
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def run_time_level(available: list[str], aten_capability: str, flags: set[str] | None) -> str | None:
    """The ahead-of-time level to load: the widest of ``available`` (level names) that ATen's capability allows
    (``"DEFAULT"``, ``"AVX2"``, ``"AVX512"``; on Arm any) and whose flags ``flags`` all holds (``None``: not
    known, ATen's word is taken); None when none qualifies."""
    if is_arm():
        return "armv8" if "armv8" in available else None
    cap = _ATEN_CAP.get(aten_capability.upper(), "x86_64_v2")
    allowed, needed = [], set()
    for name, _, extra in _X86_LEVELS:
        needed |= set(extra)
        if flags is None or needed <= flags:
            allowed.append(name)
        if name == cap:
            break
    for name in reversed(allowed):
        if name in available:
            return name
    return None
