"""Packaging beyond pyproject.toml: the optional ahead-of-time build of the toeplitz kernels.

By default nothing is compiled here: the kernels are built on first use, for the machine that runs them. With
``RELBIAS_BUILD_NATIVE=1`` (and torch importable, so ``pip install --no-build-isolation``), the kernels are compiled
now, once per instruction-set level of ``relbias/backends/toeplitz/_isa.py`` (x86-64-v2, -v3, -v4 on x86; armv8-a on
Arm), with torch's ``BuildExtension``; at run time the widest level the CPU executes is loaded, so one wheel serves
AVX2 and AVX-512 machines and needs no compiler. A wheel built so is tied to the torch version it was built
against.
"""

import os
import runpy
from pathlib import Path

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("RELBIAS_BUILD_NATIVE", "").strip() == "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as error:
        raise SystemExit(
            "RELBIAS_BUILD_NATIVE=1 compiles against the installed torch: install torch first, then "
            "`RELBIAS_BUILD_NATIVE=1 pip install --no-build-isolation .` (" + str(error) + ")"
        ) from None
    isa = runpy.run_path(str(Path(__file__).parent / "src" / "relbias" / "backends" / "toeplitz" / "_isa.py"))
    sources = [str(Path("src", "relbias", "backends", "toeplitz", "csrc", name)) for name in isa["SOURCES"]]
    digest = isa["source_digest"]()
    for level, march in isa["aot_levels"]():
        ext_modules.append(CppExtension(
            name="relbias.backends.toeplitz." + isa["AOT_PREFIX"] + level, sources=sources,
            define_macros=[("RELBIAS_SOURCE_DIGEST", digest)],
            extra_compile_args=[*isa["OPT_FLAGS"], *isa["vector_flags"](), "-g0", f"-march={march}", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ))
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
