"""``relbias bench``: time and peak memory of relative-bias attention against bias-free SDPA.

Options and printing only; what is measured and how is :mod:`relbias.benchmark`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import benchmark

__all__ = ["add_arguments", "add_shape_arguments", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="time and peak memory of attention backends vs bias-free SDPA",
        description="Time (ms: minimum and median of warmed-up, interleaved repeats) and peak memory (MiB; "
        "'peak MiB' is the fresh process's peak resident set above its post-import one, '+MiB' what the call "
        "adds over its inputs) of relative-bias attention backends, of SDPA with the bias materialised, and of "
        "a Hugging-Face-style eager path, each as a ratio to bias-free SDPA measured in the same run ('x sdpa'). "
        "Warns when the machine was busy (1-minute load average). A default run takes about 20 minutes on 2 cores "
        "(measured on a 2-core AMD EPYC, torch 2.13: lengths 512 to 4096 about 8 minutes, the 8192-token rows the "
        "rest); fewer --n, --methods or --no-memory take less.",
        formatter_class=_HelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, unless the help already says it or there is none to say (a None default,
    an on/off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a length, a count of heads or repeats); a clear error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_shape_arguments(p: argparse.ArgumentParser, *, lengths: list[int], causal: str = "both",
                        mode: str = "both") -> None:
    """The options that say which calls: ``--n``, ``--causal``, ``--mode``, ``--family``, ``--batch``, ``--heads``,
    ``--head-dim``, ``--dtype`` (shared by ``relbias bench`` and ``relbias explain``, with these defaults for the
    first three)."""
    p.add_argument("--n", type=_positive_int, nargs="+", default=lengths, help="sequence lengths (tokens)")
    p.add_argument("--causal", choices=["both", "causal", "bidirectional"], default=causal, help="masking")
    p.add_argument("--mode", choices=["both", "fwd", "fwdbwd"], default=mode,
                   help="forward (inference, no gradient) and/or forward+backward")
    from ..biases import FAMILIES

    p.add_argument("--family", choices=list(FAMILIES), default="t5", metavar="FAMILY",
                   help=f"bias family: {', '.join(FAMILIES)} ('none' = NoPE, no bias)")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size B")
    p.add_argument("--heads", type=_positive_int, default=8, help="num_heads H")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="head_dim D")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="input dtype")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relbias bench`` (shared with benchmarks/bench_attention.py)."""
    add_shape_arguments(p, lengths=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--methods", nargs="+", choices=benchmark.method_names(), default=benchmark.default_methods(),
                   help="baselines and registered backends (flex compiles per shape: forward only on CPU)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="fewest timed calls per method")
    p.add_argument("--budget-ms", type=_non_negative_float, default=500.0,
                   help="more timed calls, up to --max-repeats, until the slowest method has run this long (ms)")
    p.add_argument("--max-repeats", type=_positive_int, default=100, help="most timed calls per method")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads (default: PyTorch's choice)")
    p.add_argument("--max-scores", type=_non_negative_float, default=2.2e9,
                   help="skip materialising methods (sdpa_bias, eager, reference) above this many B*H*N*N scores")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory measurement")
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")


def _fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


#: (title, row key, format) of the table's figures; every "x sdpa" is the figure before it over SDPA's.
_COLUMNS = (("min ms", "ms", "9.2f"), ("x sdpa", "ms_x_sdpa", "7.2f"), ("med ms", "median_ms", "9.2f"),
            ("x sdpa", "median_ms_x_sdpa", "7.2f"), ("reps", "repeats", "5d"), ("peak MiB", "peak_mib", "9.0f"),
            ("x sdpa", "peak_mib_x_sdpa", "7.2f"), ("+MiB", "growth_mib", "8.0f"),
            ("x sdpa", "growth_mib_x_sdpa", "7.2f"))


def _where(row: dict) -> str:
    return f"{row['n']:>5} {'causal' if row['causal'] else 'bidi':>6} {row['mode']:>6} {row['method']:>10}"


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and a warning when the machine was busy (and write JSON with ``--json``)."""
    import torch

    from ..biases import FAMILIES

    if args.family not in FAMILIES:
        raise ValueError(f"unknown bias family {args.family!r}; known: {sorted(FAMILIES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    before = benchmark.load_sample()
    print(f"relbias bench: torch {torch.__version__}, {torch.get_num_threads()} threads, B={args.batch} "
          f"H={args.heads} D={args.head_dim} {args.dtype}, bias {args.family}; "
          f"1-minute load average {before['load_1min']:.2f}")

    def show(row):  # progress on stderr; the table with ratios follows on stdout
        what = row["error"] if "ms" not in row else f"{row['ms']:.2f} ms min, {row['median_ms']:.2f} ms median"
        print(f"measured {_where(row)}  {what}", file=sys.stderr, flush=True)

    rows = benchmark.measure(args, progress=show)
    after = benchmark.load_sample()
    warnings = [w for w in (benchmark.busy_warning(before, after), benchmark.spread_warning(rows)) if w]
    print("ratios to bias-free SDPA (same run):")
    width = [int(f.split(".")[0].rstrip("d")) for _, _, f in _COLUMNS]
    titles = " ".join(f"{t:>{w}}" for (t, _, _), w in zip(_COLUMNS, width))
    print(f"{'N':>5} {'mask':>6} {'mode':>6} {'method':>10} {titles}")
    for row in rows:
        if "ms" in row:
            print(_where(row) + " " + " ".join(f"{_fmt(row, k, f):>{w}}" for (_, k, f), w in zip(_COLUMNS, width)))
    print(f"1-minute load average after: {after['load_1min']:.2f}")
    for warning in warnings:
        print(warning)
    if args.json:
        load = {"before": before["load_1min"], "after": after["load_1min"]}
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args) | {"func": None}, "load_average": os.getloadavg(), "load_1min": load,
                       "warnings": warnings, "rows": rows}, f, indent=1)
    return 0
