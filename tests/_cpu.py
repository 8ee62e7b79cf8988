"""What this CPU runs, read from the machine (its flags, the environment that lowers oneDNN's ISA, ATen's capability)
rather than from relbias' own gates, and the refusals relbias gives there by design (not a test module).

Tests whose outcome depends on the CPU run a backend where it runs and, where it refuses by design, assert the
refusal and its reason (:func:`assert_cpu_refusal`, :func:`refused_here`), so that the same test passes on AVX2,
AVX-512 and AMX machines, under the AVX2 emulation and under ``ATEN_CPU_CAPABILITY=default``:

* half precision in relbias' native kernels (and so in the decode backend) needs the matrix units oneDNN packs for
  (AMX-BF16 / AMX-FP16); elsewhere bfloat16 / float16 run on float32 copies and decode refuses them;
* compiled FlexAttention on a CPU whose ATen capability is below AVX-512 refuses head dims below 32, and where
  inductor has no vector ISA (``ATEN_CPU_CAPABILITY=default``) it does not compile at all.
"""

from __future__ import annotations

import os
import platform
import re

import pytest
import torch

_UNITS = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}
_HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: ``flex``'s smallest head dim below AVX-512 (relbias.backends.flex.MIN_AVX2_HEAD_DIM, restated here).
FLEX_MIN_AVX2_HEAD_DIM = 32


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (``lscpu``'s Flags); empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def onednn_isa_allows_amx() -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` leaves oneDNN its AMX code (unset, ALL or DEFAULT, or an ISA named with AMX)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return isa in ("", "ALL", "DEFAULT") or "AMX" in isa


def has_matrix_units(dtype: torch.dtype) -> bool:
    """Whether this CPU, as oneDNN is allowed to see it, has the matrix units relbias' half-precision GEMMs need for
    ``dtype`` (x86 with ``amx_bf16`` / ``amx_fp16`` and oneDNN on): False for float32 / float64 and on other CPUs."""
    unit = _UNITS.get(dtype)
    return (unit is not None and platform.machine() in ("x86_64", "AMD64") and unit in cpu_flags()
            and onednn_isa_allows_amx() and torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled())


def aten_avx512() -> bool:
    """Whether ATen's CPU capability (``ATEN_CPU_CAPABILITY`` lowers it) is AVX-512."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def inductor_vector_isa() -> bool:
    """Whether inductor has a vector ISA to generate CPU code for (``ATEN_CPU_CAPABILITY=default`` leaves it none)."""
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def native_built() -> bool:
    from relbias.backends.toeplitz import _native

    return _native.native_unavailable_reason() is None


def _flex_compiles() -> bool:
    """Whether the flex backend compiles FlexAttention now (the ``small_tiles`` fixture runs it eager)."""
    from relbias.backends import flex

    return flex.COMPILE


def cpu_refusals(backend: str, query: torch.Tensor, value_dim: int | None = None) -> list[str]:
    """Regular expressions, one per refusal this CPU gives ``backend`` by design for a call on ``query`` (B, H, L, D)
    with values of ``value_dim`` (default D); empty where the CPU lets the backend run it."""
    found = []
    if not query.is_cpu:
        return found
    dtype = query.dtype
    if backend == "decode" and dtype in _UNITS and not (has_matrix_units(dtype) and native_built()):
        found.append(rf"{dtype} inputs: the decode backend's additive bias mask would round the bias, and relbias' "
                     r"native kernel, which reads it in float32, does not run this dtype here")
        if native_built():
            found.append(rf"{_HALF_NAMES[dtype]} runs on float32 copies: oneDNN finds no AMX-")
    dims = (query.shape[-1], query.shape[-1] if value_dim is None else value_dim)
    capability = re.escape(torch.backends.cpu.get_cpu_capability())
    if backend == "flex" and _flex_compiles() and not aten_avx512():
        if min(dims) < FLEX_MIN_AVX2_HEAD_DIM:
            found.append(rf"without AVX-512 \(here {capability}\) for small head dims.*must be >= "
                         rf"{FLEX_MIN_AVX2_HEAD_DIM} here")
        elif not inductor_vector_isa():  # inductor's CPU FlexAttention lowering needs a vector ISA
            found.append(rf"compiled FlexAttention in torch \S+ does not compile here \({capability}, ")
    return found


#: What each CPU-dependent refusal says, whichever CPU: a refusal that says it where :func:`cpu_refusals` expects
#: none is a wrong refusal.
_CPU_WORDS = ("does not run this dtype here", "runs on float32 copies", "for small head dims", "does not compile here")


def assert_cpu_refusal(backend: str, why: str, query: torch.Tensor, value_dim: int | None = None) -> bool:
    """Check a refusal ``why`` of ``backend`` against this CPU: every refusal :func:`cpu_refusals` expects is in it,
    and no CPU-dependent words are in it where none is expected. Returns whether a refusal by design was expected
    (and so asserted)."""
    expected = cpu_refusals(backend, query, value_dim)
    for pattern in expected:
        assert re.search(pattern, why, re.S), f"expected /{pattern}/ in: {why}"
    if not expected and backend in ("decode", "flex"):
        assert not any(words in why for words in _CPU_WORDS), why
    return bool(expected)


def refused_here(backend: str, why: str, query: torch.Tensor, value_dim: int | None = None) -> None:
    """For a test that skips a call ``backend`` refuses for reasons of the call (not of the CPU): return where the
    refusal is this CPU's by design (asserted, so the test passes), else skip with the reason."""
    if not assert_cpu_refusal(backend, why, query, value_dim):
        pytest.skip(why)
