"""Benchmark: the toeplitz kernels against bias-free SDPA on each x86 instruction-set level this CPU can run.

Users run relbias on AVX-512 and AVX2-only x86 CPUs alike (and on Arm). A speed measured on one level says nothing
about another: the kernels' vector code is what the compiler makes of it for that level. This script measures the
same calls at each level the machine can execute, by giving each its own environment, which lowers every component
that picks its code at run time:

* ``native``: nothing lowered (this CPU's widest level; ``-march=native`` kernels);
* ``avx2``: ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
  RELBIAS_NATIVE_MARCH=x86-64-v3``: SDPA, the BLAS and the kernels all run AVX2 code (an AVX2-only CPU emulated
  on an AVX-512 one; on an AVX2 CPU it is the same as ``native``);
* ``sse``: ``ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
  RELBIAS_NATIVE_MARCH=x86-64-v2`` (the baseline level; not run by default).

Each (level, family) is one ``relbias bench`` run (:mod:`relbias.benchmark`: warm-up, interleaved repeats, minimum and
median) in its own process: forward at ``--n-fwd`` and forward+backward at ``--n-fwdbwd`` tokens, causal and
bidirectional, B=1 H=8 D=64 ``--dtype`` (default float32), ``--threads`` threads; the kernels for each level are built
(or loaded from the cache) before its first timed run. Printed: toeplitz's time as a ratio to SDPA's in the same run
(minimum / median), marked ``!`` above the target (forward 1.15x, forward+backward 1.25x), and the load average before
and after. The emulated levels stand for CPUs of those levels only as far as their code goes: caches, clocks and the
BLAS's choices for another vendor's CPU are this machine's.

Usage::

    python benchmarks/bench_isa.py                                  # native and avx2, every offset-only family
    python benchmarks/bench_isa.py --isas avx2 --families t5 alibi --n-fwd 4096 --n-fwdbwd 2048
    python benchmarks/bench_isa.py --dtype bfloat16                 # against bias-free SDPA in bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Each level's environment (see the module docstring).
ISAS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "RELBIAS_NATIVE_MARCH": "x86-64-v3"},
    "sse": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
            "RELBIAS_NATIVE_MARCH": "x86-64-v2"},
}
#: The offset-only families (every one the toeplitz kernels run; FIRE has no per-offset form).
FAMILIES = ("t5", "offset", "alibi", "kerple_log", "kerple_power")
TARGETS = {"fwd": 1.15, "fwdbwd": 1.25}
_BENCH = Path(__file__).with_name("bench_attention.py")


def _run(isa: str, command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **ISAS[isa]}
    return subprocess.run(command, env=env, capture_output=True, text=True)


def measure(isa: str, family: str, mode: str, n: int, args: argparse.Namespace) -> dict:
    """{causal: (min ratio, median ratio)} of toeplitz / sdpa, or {"error": text}, for one relbias bench run."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        done = _run(isa, [sys.executable, str(_BENCH), "--family", family, "--n", str(n), "--mode", mode,
                          "--methods", "sdpa", "toeplitz", "--no-memory", "--repeats", str(args.repeats),
                          "--threads", str(args.threads), "--dtype", args.dtype, "--json", out])
        if done.returncode != 0 or not os.path.exists(out):
            return {"error": (done.stderr or done.stdout).strip()[-300:]}
        with open(out) as handle:
            rows = json.load(handle)["rows"]
    return {row["causal"]: (row["ms_x_sdpa"], row["median_ms_x_sdpa"]) for row in rows
            if row["method"] == "toeplitz" and "ms_x_sdpa" in row}


def _cell(pair: tuple[float, float] | None, target: float) -> str:
    if pair is None:
        return "-"
    return f"{pair[0]:.2f} / {pair[1]:.2f}" + (" !" if pair[0] > target else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--isas", nargs="+", default=["native", "avx2"], choices=list(ISAS), help="levels to run")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--n-fwd", type=int, default=8192, help="tokens of the forward calls")
    parser.add_argument("--n-fwdbwd", type=int, default=4096, help="tokens of the forward+backward calls")
    parser.add_argument("--repeats", type=int, default=3, help="fewest timed calls per method")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="inputs' dtype (SDPA runs the same)")
    args = parser.parse_args(argv)

    print(f"{args.dtype}; load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    header = (f"{'level':7s} {'family':13s} {'fwd ' + str(args.n_fwd) + ' causal':>17s} {'bidi':>13s} "
              f"{'fwd+bwd ' + str(args.n_fwdbwd) + ' causal':>21s} {'bidi':>13s}")
    print("toeplitz / sdpa, minimum / median of interleaved repeats ('!': above the target)")
    print(header)
    failed = False
    for isa in args.isas:
        built = _run(isa, [sys.executable, "-m", "relbias", "build"])
        variant = (built.stdout.strip().splitlines() or ["?"])[0]
        print(f"{isa}: {variant}", flush=True)
        for family in args.families:
            cells = []
            for mode, n in (("fwd", args.n_fwd), ("fwdbwd", args.n_fwdbwd)):
                result = measure(isa, family, mode, n, args)
                if "error" in result:
                    print(f"  {family} {mode} failed: {result['error']}")
                    failed = True
                cells += [_cell(result.get(True), TARGETS[mode]), _cell(result.get(False), TARGETS[mode])]
            print(f"{isa:7s} {family:13s} {cells[0]:>17s} {cells[1]:>13s} {cells[2]:>21s} {cells[3]:>13s}",
                  flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
