"""The flex backend is never silently wrong: kernels that disagree with SDPA are refused with the reason,
small head dims are refused on CPUs without AVX-512, and varying lengths never reach eager FlexAttention
(which would materialise the scores)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import relbias
from relbias.backends import flex

from .._markers import requires_inductor_vector_isa

pytestmark = pytest.mark.skipif(not flex.flex_available(torch.device("cpu"), torch.float32, False)[0],
                                reason="FlexAttention cannot be compiled here")


@pytest.fixture
def fresh_checks(monkeypatch):
    monkeypatch.setattr(flex, "COMPILE", True)
    monkeypatch.setattr(flex, "_CHECKED", {})


def test_a_kernel_that_disagrees_with_sdpa_is_refused_with_the_reason(fresh_checks, monkeypatch):
    def wrong_in_the_last_slice(q, k, v, **kwargs):  # what torch 2.13 does on AVX2 CPUs for head_dim 8
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=kwargs.get("scale"))
        out[-1, -1] = float("nan")
        return out

    monkeypatch.setattr(flex, "_run", wrong_in_the_last_slice)
    q = torch.randn(1, 2, 8, 32)
    with torch.no_grad(), pytest.raises(ValueError, match=r"backend 'flex' cannot run this call: compiled FlexAttention "
                                                          rf"in torch {re.escape(torch.__version__)} returns wrong values here .*"
                                                          r"head_dim 32\): max error nan"):
        relbias.attention(q, q, q, backend="flex")
    assert flex._CHECKED[("cpu", None, torch.float32, 32, 32)] is not None  # checked once, then cached


def test_a_kernel_that_does_not_compile_is_refused_with_the_compiler_error(fresh_checks, monkeypatch):
    def no_lowering(q, k, v, **kwargs):  # torch 2.13 under ATEN_CPU_CAPABILITY=default (no vector ISA)
        raise NotImplementedError("torch.compile on current platform is not supported for CPU")

    monkeypatch.setattr(flex, "_run", no_lowering)
    q = torch.randn(1, 2, 8, 32)
    with torch.no_grad(), pytest.raises(ValueError, match=r"backend 'flex' cannot run this call: compiled FlexAttention "
                                                          r".* does not compile here .*NotImplementedError: torch.compile"):
        relbias.explain_backend(q, q, q, backend="flex")
    assert relbias.explain_backend(q, q, q)[0] != "flex"  # auto passes it over


def test_small_head_dims_are_refused_on_cpus_without_avx512(fresh_checks, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(flex, "_run", lambda *a, **k: pytest.fail("no probe may run"))
    q = torch.randn(2, 4, 40, 16)
    with torch.no_grad(), pytest.raises(ValueError, match=r"on CPUs without AVX-512 \(here AVX2\).*head_dim 16"):
        relbias.explain_backend(q, q, q, backend="flex")


def test_under_avx2_code_no_wrong_value_leaves_attention(tmp_path):
    """The issue's failing case (B=2, H=4, L=40, D=8) with inductor generating AVX2 code, in a child process:
    every call is refused with a reason or equals the reference."""
    code = (
        "import json, torch, relbias\n"
        "torch.manual_seed(0); torch.set_num_threads(1); results = {}\n"
        "for d in (8, 32):\n"
        "    q, k, v = (torch.randn(2, 4, 40, d) for _ in range(3))\n"
        "    bias = relbias.ALiBiBias(4, bidirectional=True)\n"
        "    with torch.no_grad():\n"
        "        try:\n"
        "            out = relbias.attention(q, k, v, bias=bias, backend='flex')\n"
        "        except ValueError as exc:\n"
        "            results[d] = str(exc); continue\n"
        "        want = relbias.attention(q, k, v, bias=bias, backend='reference')\n"
        "    results[d] = (out - want).abs().max().item()\n"
        "print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), 'results': results}))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["capability"] == "AVX2"
    assert "without AVX-512" in report["results"]["8"]  # refused, naming the reason
    for d, result in report["results"].items():
        assert isinstance(result, str) or result < 1e-5, (d, result)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


@requires_inductor_vector_isa
def test_twenty_lengths_and_decode_steps_compile_per_bucket_and_stay_fused(monkeypatch):
    """20 distinct lengths (10 square blocks, 10 KV-cache decode steps) compile at most twice, then a 4096-token
    causal call still adds O(N·D) memory (eager FlexAttention would add B·H·N² scores: 128 MiB here)."""
    monkeypatch.setattr(flex, "COMPILE", True)
    torch._dynamo.reset()
    flex._compiled.cache_clear()
    bias = relbias.ALiBiBias(2)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # eager FlexAttention warns that it is unfused
        for n in range(100, 110):
            q = torch.randn(1, 2, n, 32)
            relbias.attention(q, q, q, bias=bias, is_causal=True, backend="flex")
        for n in range(100, 110):  # one query against a growing cache: its position moves every step
            q, k = torch.randn(1, 2, 1, 32), torch.randn(1, 2, n, 32)
            got = relbias.attention(q, k, k, bias=bias, is_causal=True, backend="flex")
            torch.testing.assert_close(got, relbias.attention(q, k, k, bias=bias, is_causal=True, backend="reference"),
                                       rtol=1e-5, atol=1e-5)
        compiled = counters["stats"]["unique_graphs"] - before
        assert compiled <= 2 + 2, compiled  # two length buckets (+ the two kernel-check probes)
        q, k, v = (torch.randn(1, 2, 4096, 32) for _ in range(3))
        relbias.attention(q[:, :, :3000], k[:, :, :3000], v[:, :, :3000], bias=bias, is_causal=True, backend="flex")
        with open("/proc/self/clear_refs", "w") as f:  # reset this process's peak resident set (VmHWM)
            f.write("5")
        rss = _status_mib("VmRSS")
        out = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="flex")
        growth = _status_mib("VmHWM") - rss
    assert growth < 40, f"{growth:.0f} MiB above the inputs: the scores were materialised"
    want = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="blockwise")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
