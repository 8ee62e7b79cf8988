"""Skip markers shared by test modules (not a test module)."""

from __future__ import annotations

import os

import pytest

#: For tests that compile FlexAttention with inductor on the CPU. ``ATEN_CPU_CAPABILITY=default`` leaves inductor
#: no vector ISA (it then generates scalar C++, which compiles and runs), and inductor's CPU lowering of
#: FlexAttention needs one: torch 2.13 raises NotImplementedError ("torch.compile on current platform is not
#: supported for CPU"). These tests are skipped under that setting only; the other compiled tests run there.
requires_inductor_vector_isa = pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "default",
    reason="ATEN_CPU_CAPABILITY=default leaves inductor no vector ISA, which its CPU FlexAttention lowering needs "
           "(NotImplementedError in torch 2.13)",
)


def triton_runs_on_cpu() -> bool:
    """Whether the triton backend takes CPU tensors in this process: triton installed and TRITON_INTERPRET=1 set
    before its kernels load. Elsewhere it refuses every CPU call (it runs on CUDA), so the tests that go through
    every backend leave it out."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
