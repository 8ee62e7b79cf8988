"""The sanitizer build of the native toeplitz kernels (RELBIAS_NATIVE_SANITIZE=1): which values the variable takes,
the flags, folder and module name of the build (never those of the normal build), the ahead-of-time modules skipped,
a clear error where the ASan runtime is not preloaded, and the CLI's help. The builds are faked (test_native_build's
fixture); .ci/sanitize builds and runs the real one."""

from __future__ import annotations

import pytest

from relbias.backends.toeplitz import _build as _native_build, _isa as _native_isa
from relbias.cli.main import build_parser

from .test_native_build import fake_build  # noqa: F401 - the fixture


@pytest.mark.parametrize("value, wanted", [(None, False), ("", False), ("0", False), (" 0 ", False), ("1", True),
                                           (" 1\n", True)])
def test_relbias_native_sanitize_takes_0_or_1(value, wanted):
    environ = {} if value is None else {"RELBIAS_NATIVE_SANITIZE": value}
    assert _native_isa.sanitize_requested(environ) is wanted


@pytest.mark.parametrize("value", ["yes", "2", "true", "address"])
def test_another_value_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=rf"RELBIAS_NATIVE_SANITIZE must be 1 .* got '{value}'"):
        _native_isa.sanitize_requested({"RELBIAS_NATIVE_SANITIZE": value})


def test_the_sanitizer_build_has_its_flags_folder_and_name(fake_build, monkeypatch, tmp_path):
    monkeypatch.delenv("RELBIAS_NATIVE_SANITIZE", raising=False)
    monkeypatch.setattr(_native_build, "asan_runtime_loaded", lambda: True)
    _, plain = _native_build.build()
    monkeypatch.setenv("RELBIAS_NATIVE_SANITIZE", "1")
    monkeypatch.setattr(_native_build, "_aot_module", lambda: pytest.fail("a sanitizer build skips the AOT modules"))
    module, variant = _native_build.build()
    assert variant == "built on first use (-march=native, OpenMP, ASan + UBSan)" and plain != variant
    assert fake_build.calls[-1] == [*_native_isa.SANITIZE_FLAGS, "-march=native", "-fopenmp"]
    assert {"-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer"} <= set(fake_build.calls[-1])
    folders = sorted(p.name.split("-")[0] for p in (tmp_path / "relbias").iterdir())
    assert folders == ["toeplitz_native", "toeplitz_native_sanitize"]  # one each, never shared
    assert module.name.startswith("relbias_toeplitz_native_sanitize_")
    assert list((tmp_path / "relbias").glob(f"toeplitz_native_sanitize-*/{module.name}.so"))


def test_without_the_asan_runtime_nothing_is_compiled_and_the_error_says_how(fake_build, monkeypatch):
    monkeypatch.setenv("RELBIAS_NATIVE_SANITIZE", "1")
    monkeypatch.setattr(_native_build, "asan_runtime_loaded", lambda: False)
    with pytest.raises(RuntimeError, match=r"RELBIAS_NATIVE_SANITIZE=1 .*LD_PRELOAD=\"\$\(g\+\+ -print-file-name="
                                           r"libasan.so\) \$\(g\+\+ -print-file-name=libstdc\+\+.so.6\)\" "
                                           r"ASAN_OPTIONS=detect_leaks=0"):
        _native_build.build()
    assert fake_build.calls == []


def test_relbias_build_help_names_the_variable():
    sub = build_parser()._subparsers._group_actions[0].choices["build"]
    assert "RELBIAS_NATIVE_SANITIZE=1" in " ".join(sub.format_help().split())
