"""How the native toeplitz kernels are obtained (relbias.backends.toeplitz._isa, _native_build): the instruction-set
level an ahead-of-time install loads, the architecture flag of a build on first use, the announcement of a first
build, the retry without OpenMP, and the package data that a wheel must carry. The builds themselves are faked here
(a real one takes a minute); .ci/wheels builds and runs them for real."""

from __future__ import annotations

import fnmatch
import logging
import sys
import types
from pathlib import Path

import pytest

from relbias.backends.toeplitz import _build as _native_build, _isa as _native_isa

V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ALL = ["x86_64_v2", "x86_64_v3", "x86_64_v4"]


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(_native_isa.platform, "machine", lambda: "x86_64")


@pytest.mark.parametrize("capability, flags, available, want", [
    ("AVX512", V4, ALL, "x86_64_v4"),
    ("AVX2", V4, ALL, "x86_64_v3"),  # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU
    ("DEFAULT", V4, ALL, "x86_64_v2"),
    ("AVX512", V3, ALL, "x86_64_v3"),  # ATen's word is capped by what the CPU lists
    ("AVX512", V4 - {"avx512cd"}, ALL, "x86_64_v3"),
    ("AVX512", V4 - {"movbe"}, ALL, "x86_64_v2"),  # a v3 flag missing: no v4 either
    ("AVX512", None, ALL, "x86_64_v4"),  # flags unknown (not Linux): ATen's word
    ("AVX512", V4, ["x86_64_v2"], "x86_64_v2"),
    ("AVX2", V4, ["x86_64_v4"], None),  # only a level wider than allowed is installed
    ("DEFAULT", V2 - {"popcnt"}, ALL, None),
    ("AVX512", V4, [], None),
])
def test_the_widest_installed_level_the_cpu_and_aten_allow(x86, capability, flags, available, want):
    assert _native_isa.run_time_level(available, capability, flags) == want


def test_levels_and_arch_flags_per_machine():
    assert [name for name, _ in _native_isa.aot_levels("x86_64")] == ALL
    assert _native_isa.aot_levels("aarch64") == (("armv8", "armv8-a"),)
    assert _native_isa.aot_levels("riscv64") == ()
    assert _native_isa.jit_arch_flag({}, "x86_64") == "-march=native"
    assert _native_isa.jit_arch_flag({}, "aarch64") == "-mcpu=native"
    assert _native_isa.jit_arch_flag({}, "arm64") == "-mcpu=native"
    assert _native_isa.jit_arch_flag({"RELBIAS_NATIVE_MARCH": " x86-64-v2 "}, "x86_64") == "-march=x86-64-v2"
    with pytest.raises(ValueError, match=r"RELBIAS_NATIVE_MARCH must be one -march value .* got 'x86-64 -O0'"):
        _native_isa.jit_arch_flag({"RELBIAS_NATIVE_MARCH": "x86-64 -O0"}, "x86_64")
    # 512-bit vectors preferred where the target has AVX-512: an x86 flag that Arm compilers refuse
    assert _native_isa.vector_flags("x86_64") == _native_isa.vector_flags("AMD64") == ("-mprefer-vector-width=512",)
    assert _native_isa.vector_flags("aarch64") == _native_isa.vector_flags("arm64") == ()


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t: x\n")
    assert _native_isa.cpu_flags(str(info)) == {"fpu", "avx2", "fma"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert _native_isa.cpu_flags(str(info)) == {"fp", "asimd", "sve"}
    assert _native_isa.cpu_flags(str(tmp_path / "missing")) is None


def test_every_file_the_build_reads_is_package_data():
    """A wheel carries what the build on first use compiles and hashes: every file in csrc/ is a source or a header
    of the build, and pyproject.toml's package data matches each of them."""
    tomllib = pytest.importorskip("tomllib")
    root = _native_isa.CSRC.parents[4]
    if not (root / "pyproject.toml").exists():
        pytest.skip("not a source checkout")
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["relbias.backends.toeplitz"]
    files = sorted(p.name for p in _native_isa.CSRC.iterdir() if p.is_file())
    assert files == sorted(_native_isa.SOURCES + _native_isa.HEADERS)
    for name in files:
        assert any(fnmatch.fnmatch(f"csrc/{name}", pattern) for pattern in shipped), (name, shipped)


@pytest.mark.parametrize("text, refused", [
    ("clang: error: unsupported option '-fopenmp'", True),  # Apple clang
    ("c++: error: unrecognized command-line option '-fopenmp'", True),
    ("fatal error: 'omp.h' file not found", True),  # clang on Linux without libomp
    ("/usr/bin/ld: cannot find -lomp: No such file or directory", True),
    ("ld: library not found for -lomp", True),
    # any other failure: the command line names -fopenmp too, but the compiler did not refuse it
    ("[1/3] c++ -MMD -O3 -march=native -fopenmp -c toeplitz_forward.cpp\nerror: 'foo' was not declared", False),
])
def test_an_openmp_refusal_is_told_from_other_build_errors(text, refused):
    assert _native_build.lacks_openmp(text) is refused


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """cpp_extension.load replaced by a recorder that "builds" (writes the .so) unless the compiler refuses OpenMP
    (``refuse_openmp``); the cache in a temporary folder; no ahead-of-time module installed."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("RELBIAS_NATIVE_MARCH", raising=False)
    monkeypatch.setattr(_native_build, "_aot_module", lambda: None)
    state = types.SimpleNamespace(calls=[], refuse_openmp=False)

    def load(*, name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        state.calls.append(list(extra_cflags))
        if state.refuse_openmp and "-fopenmp" in extra_cflags:
            raise RuntimeError(f"Error building extension '{name}': c++ {' '.join(extra_cflags)}\n"
                               "clang: error: unsupported option '-fopenmp'")
        (tmp_path / build_directory / f"{name}.so").write_bytes(b"")
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(cpp_extension, "load", load)
    return state


def test_the_first_build_is_announced_once_with_its_folder(fake_build, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        module, variant = _native_build.build()
        again, _ = _native_build.build()  # built: loaded from the cache without a word
    announced = [r.getMessage() for r in caplog.records]
    assert len(announced) == 1 and "compiling the toeplitz kernels" in announced[0]
    assert str(tmp_path / "relbias") in announced[0] and "`relbias build` does it ahead of time" in announced[0]
    assert variant == "built on first use (-march=native, OpenMP)" and again.name == module.name
    opt = ["-O3", "-fno-trapping-math", *_native_isa.vector_flags(), "-march=native"]
    assert fake_build.calls == [[*opt, "-fopenmp"]] * 2


def test_a_compiler_without_openmp_gets_a_single_threaded_build_and_advice(fake_build, monkeypatch, caplog):
    fake_build.refuse_openmp = True
    monkeypatch.setenv("CXX", "clang++")
    with pytest.warns(RuntimeWarning, match=r"built without OpenMP .*brew install llvm"):
        _, variant = _native_build.build()
    assert variant == "built on first use (-march=native, no OpenMP: one thread per call)"
    opt = ["-O3", "-fno-trapping-math", *_native_isa.vector_flags(), "-march=native"]
    assert fake_build.calls == [[*opt, "-fopenmp"], [*opt, "-fopenmp-simd"]]
    with pytest.warns(RuntimeWarning, match="built without OpenMP"):
        _native_build.build()  # the next process: straight to the build without OpenMP
    assert fake_build.calls[2:] == [["-O3", "-fno-trapping-math", *_native_isa.vector_flags(), "-march=native",
                                      "-fopenmp-simd"]]
    monkeypatch.setenv("CXX", "g++")  # another compiler: OpenMP is tried again
    fake_build.refuse_openmp = False
    assert _native_build.build()[1] == "built on first use (-march=native, OpenMP)"


def test_other_build_errors_are_raised_not_retried(fake_build, monkeypatch):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        fake_build.calls.append(kwargs["extra_cflags"])
        raise RuntimeError("Error building extension: -fopenmp ... error: 'foo' was not declared")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match="was not declared"):
        _native_build.build()
    assert len(fake_build.calls) == 1


def test_relbias_native_march_builds_for_that_march(fake_build, monkeypatch):
    monkeypatch.setenv("RELBIAS_NATIVE_MARCH", "x86-64-v2")
    monkeypatch.setattr(_native_build, "_aot_module", lambda: pytest.fail("an explicit march skips the AOT modules"))
    assert _native_build.build()[1] == "built on first use (-march=x86-64-v2, OpenMP)"


def _installed(monkeypatch, modules: dict):
    """Pretend that the ahead-of-time ``modules`` (level -> module, or an ImportError to raise) are installed."""
    prefix = f"{_native_build.__package__}.{_native_isa.AOT_PREFIX}"
    real_find = _native_build.importlib.util.find_spec
    monkeypatch.setattr(_native_build.importlib.util, "find_spec",
                        lambda name: object() if name.startswith(prefix) and name[len(prefix):] in modules
                        else real_find(name))
    real_import = _native_build.importlib.import_module

    def import_module(name, package=None):
        found = modules.get(name[len(prefix):]) if name.startswith(prefix) else None
        if isinstance(found, Exception):
            raise found
        return found if found is not None else real_import(name, package)

    monkeypatch.setattr(_native_build.importlib, "import_module", import_module)


def test_an_installed_ahead_of_time_module_is_taken_when_built_from_these_sources(x86, monkeypatch, caplog):
    monkeypatch.setattr(_native_build.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(_native_isa, "cpu_flags", lambda: V4)
    digest = _native_isa.source_digest()
    v2, v3 = types.SimpleNamespace(source_digest=digest), types.SimpleNamespace(source_digest=digest)
    _installed(monkeypatch, {"x86_64_v2": v2, "x86_64_v3": v3})
    assert _native_build._aot_module() == (v3, "ahead-of-time build for x86_64_v3")
    v3.source_digest = "0" * 16  # built from other sources (an edited checkout): not loaded, and said so
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        assert _native_build._aot_module() is None
    assert "built from other sources" in caplog.text


def test_an_ahead_of_time_module_that_does_not_load_is_logged(x86, monkeypatch, caplog):
    monkeypatch.setattr(_native_build.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(_native_isa, "cpu_flags", lambda: V4)
    _installed(monkeypatch, {"x86_64_v4": ImportError("undefined symbol: _ZN3c10...")})
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        assert _native_build._aot_module() is None
    assert "x86_64_v4" in caplog.text and "undefined symbol" in caplog.text


def test_each_copy_of_the_sources_builds_in_its_own_folder(fake_build, monkeypatch, tmp_path, caplog):
    """ninja rebuilds when the same sources sit elsewhere (another checkout or venv): each location gets its own
    folder, and its first build is announced, instead of two installs rebuilding one folder in turn."""
    import shutil

    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(_native_isa.CSRC, copy)
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        first, _ = _native_build.build()
        monkeypatch.setattr(_native_isa, "CSRC", copy)
        second, _ = _native_build.build()
    assert first.name != second.name
    assert len([r for r in caplog.records if "compiling the toeplitz kernels" in r.getMessage()]) == 2


def test_the_build_notice_the_readme_and_the_docs_state_one_time_and_one_command():
    """The time a first build takes and the command that builds ahead, as the notice says them, are what the README
    and the docs say."""
    root = Path(__file__).resolve().parents[2]
    notice = _native_build.build_notice("-march=native", "OpenMP", Path("/cache"))
    assert _native_build.BUILD_TIME in notice and f"`{_native_build.BUILD_COMMAND}`" in notice
    for page in ("README.md", "docs/index.md", "docs/native-kernels.md"):
        text = " ".join((root / page).read_text().split())  # line breaks as spaces
        assert _native_build.BUILD_TIME in text or _native_build.BUILD_TIME.replace(" on 2 cores", "") in text, page
        assert f"`{_native_build.BUILD_COMMAND}`" in text, page
        assert "about a minute" not in text and "45 s" not in text, page
