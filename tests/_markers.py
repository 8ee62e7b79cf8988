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
