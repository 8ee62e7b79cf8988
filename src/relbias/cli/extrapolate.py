"""``relbias extrapolate``: train tiny byte-level LMs per position scheme (and seed) at length L, evaluate at
L, 2L, 4L, 8L (up to 32L and beyond with --eval-lengths)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

__all__ = ["register", "run"]

#: --quick: a smoke test of every scheme in about a minute on 2 CPU cores.
QUICK = {"steps": 200, "batch_size": 16, "max_eval_bytes": 8192}
DEFAULTS = {"steps": 1200, "batch_size": 32, "max_eval_bytes": None}
#: Schemes of a run without --schemes; None: every registered bias family (the baselines only when asked for).
DEFAULT_SCHEMES: list[str] | None = None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _seed_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 (e.g. 0,1,2), got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0 (e.g. 0,1,2), got {text!r}")
    return values


def _option(text: str) -> tuple[str, str, object]:
    """``FAMILY.KEY=VALUE`` -> (family, key, value); VALUE is a Python literal (12, 0.5, 'clip') or a bare word."""
    target, sep, raw = text.partition("=")
    family, dot, key = target.partition(".")
    if not sep or not dot or not family or not key:
        raise argparse.ArgumentTypeError(f"expected FAMILY.KEY=VALUE (e.g. t5.max_distance=128), got {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return family, key, value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``extrapolate`` subcommand."""
    p = subparsers.add_parser(
        "extrapolate",
        help="train a tiny byte-level LM per position scheme at length L; evaluate at L, 2L, 4L, 8L",
        description="Train one small byte-level decoder LM per position scheme (and per seed) on a corpus at "
        "training length L, then report bits per byte and perplexity on held-out text at longer lengths, as the "
        "mean across seeds with a 95%% Student-t interval, with full attention and (by default) with attention "
        "limited to L (--windowed-eval) side by side. Writes results.json, results.md and results.png into "
        "--out after each model.",
    )
    p.add_argument("--schemes", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="comma-separated bias families and baselines (sinusoidal, rotary); default: every "
                        "registered family")
    p.add_argument("--corpus", type=Path, help="UTF-8 text file or folder (default: Python's pydoc_data.topics)")
    p.add_argument("--out", type=Path,
                   help="output folder (default runs/extrapolate, or runs/extrapolate-quick with --quick)")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished (scheme, seed) runs of --out/results.json, run the rest")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK['steps']} steps of {QUICK['batch_size']} windows, "
                        f"{QUICK['max_eval_bytes']} evaluation bytes")
    p.add_argument("--train-len", type=int, default=64, help="training length L in bytes (default %(default)s)")
    p.add_argument("--eval-lengths", type=_int_list,
                   help="comma-separated evaluation lengths (default L,2L,4L,8L; e.g. up to 32L: 64,...,2048)")
    p.add_argument("--eval-mode", choices=["nonoverlapping", "sliding"], default="nonoverlapping",
                   help="windows that do not overlap, or sliding windows --stride apart scoring only their new "
                        "bytes (Press et al. 2022, section 4; default %(default)s)")
    p.add_argument("--stride", type=int,
                   help="sliding stride S in bytes, 1 <= S <= the shortest evaluation length (default L); "
                        "sliding costs about n/S times non-overlapping at length n")
    p.add_argument("--windowed-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="beside full attention, evaluate every model with attention limited to the training length "
                        "at every evaluation length: each layer's window=(L-1, 0), each byte seeing itself and at "
                        "most L-1 earlier bytes, as in training; and once over the whole scored text in one windowed "
                        "forward (every byte after the first L-1 with a full window of L bytes at every layer, at "
                        "the cost of one pass). "
                        "Linear in the length with the fused kernels: a few seconds per model (default: on)")
    p.add_argument("--min-windows", type=int, default=8,
                   help="refuse an evaluation length the held-out text fills with fewer windows (default %(default)s)")
    p.add_argument("--steps", type=int, help=f"training steps (default {DEFAULTS['steps']})")
    p.add_argument("--batch-size", type=int, help=f"windows per step (default {DEFAULTS['batch_size']})")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default %(default)s)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, help="one seed of initialisation and batches (default 0)")
    seeds.add_argument("--seeds", type=_seed_list,
                       help="comma-separated seeds (e.g. 0,1,2): every scheme is trained once per seed")
    seeds.add_argument("--num-seeds", type=int, help="seeds 0 .. N-1")
    p.add_argument("--embed-dim", type=int, default=64, help="model width (default %(default)s)")
    p.add_argument("--num-heads", type=int, default=4, help="attention heads (default %(default)s)")
    p.add_argument("--num-layers", type=int, default=2, help="decoder blocks (default %(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out share of the corpus (default %(default)s)")
    p.add_argument("--max-eval-bytes", type=int, help="evaluate on at most this many held-out bytes (default all)")
    p.add_argument("--offset-out-of-range", choices=["clip", "error"], default="clip",
                   help="per-offset bias beyond L: reuse the last offset's scalar, or fail (default %(default)s)")
    p.add_argument("--set", dest="options", type=_option, action="append", default=[], metavar="FAMILY.KEY=VALUE",
                   help="family option, repeatable (e.g. t5.max_distance=128, t5.num_buckets=16)")
    p.add_argument("--convention", choices=["seed", "additive", "t5"], help="score convention for all (default: each family's)")
    p.add_argument("--backend", default="auto", help="attention backend: auto, reference, blockwise, ... (default %(default)s)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="torch threads (default %(default)s, at most 2: a training step of the default model took 35 ms "
                        "with 2 threads and 55 ms with 1 on a 2-core machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _progress_hook(disabled: bool):
    """(progress hook, line printer, context): tqdm bars on stderr and a context in which relbias' log lines (the
    kernels' build notice) are written through tqdm, above the bars; or none with --no-progress (tqdm then
    optional)."""
    try:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError as exc:
        if disabled:
            return (lambda iterable, **_: iterable), print, contextlib.nullcontext()
        raise RuntimeError("progress bars need tqdm: pip install 'relbias[cli]' (or pass --no-progress)") from exc

    def hook(iterable, *, desc: str = "", total: int | None = None):
        return tqdm(iterable, desc=desc, total=total, leave=False, disable=disabled, dynamic_ncols=True, file=sys.stderr)

    redirect = logging_redirect_tqdm([logging.getLogger("relbias")], tqdm_class=tqdm)
    return hook, tqdm.write, contextlib.nullcontext() if disabled else redirect


def _load_kernels(backend: str) -> None:
    """Build or load the native kernels that training on CPU runs (``auto`` and ``toeplitz``) before the first
    progress bar and the first training timer start: a first build takes about 50 s, which a bar would count as its
    first step's time and the results as the first scheme's training time."""
    if backend in ("auto", "toeplitz"):
        from ..backends.toeplitz import _native

        _native.load_native()


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def run(args: argparse.Namespace) -> int:
    """Run the experiment and print the tables; see ``relbias extrapolate --help``."""
    import torch

    from ..biases.registry import FAMILIES
    from ..experiments import ExtrapolationConfig, TrainConfig, load_corpus, run_extrapolation
    from ..experiments.extrapolate import known_schemes
    from ..experiments.positional import BASELINES
    from ..experiments.report import INTERVAL_NOTE, WHOLE_TEXT, format_table, window_note, windowed

    preset = QUICK if args.quick else DEFAULTS
    steps = args.steps if args.steps is not None else preset["steps"]
    batch_size = args.batch_size if args.batch_size is not None else preset["batch_size"]
    max_eval_bytes = args.max_eval_bytes if args.max_eval_bytes is not None else preset["max_eval_bytes"]
    for name, value in (("--train-len", args.train_len), ("--steps", steps), ("--batch-size", batch_size),
                        ("--threads", args.threads), ("--max-eval-bytes", max_eval_bytes or 1),
                        ("--num-seeds", 1 if args.num_seeds is None else args.num_seeds), ("--min-windows", args.min_windows)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.stride is not None and args.eval_mode != "sliding":
        raise ValueError(f"--stride {args.stride} applies to --eval-mode sliding, not {args.eval_mode}")
    if args.num_seeds is not None:
        seed_list = list(range(args.num_seeds))
    else:
        seed_list = args.seeds or [0 if args.seed is None else args.seed]
    if len(set(seed_list)) != len(seed_list):
        raise ValueError(f"--seeds must not repeat, got {','.join(map(str, seed_list))}")
    threads = args.threads
    schemes = args.schemes if args.schemes else list(DEFAULT_SCHEMES or FAMILIES)
    unknown = [s for s in schemes if s not in known_schemes()]  # every scheme, before anything is printed or read
    if unknown:
        raise ValueError(
            f"unknown scheme(s) {unknown}; registered families: {sorted(FAMILIES)}, baselines: {sorted(BASELINES)}"
        )
    repeated = sorted({s for s in schemes if schemes.count(s) > 1})
    if repeated:
        raise ValueError(f"schemes must not repeat, got {schemes} ({', '.join(repeated)} more than once)")
    eval_lengths = args.eval_lengths or [args.train_len * m for m in (1, 2, 4, 8)]
    scheme_options: dict[str, dict] = {"offset": {"out_of_range": args.offset_out_of_range}}
    for family, key, value in args.options:
        if family in BASELINES and family not in FAMILIES:
            raise ValueError(f"--set {family}.{key}={value}: the {family!r} baseline takes no options")
        if family not in schemes:
            known = "a registered family" if family in FAMILIES else f"not a registered family {sorted(FAMILIES)}"
            raise ValueError(
                f"--set {family}.{key}={value}: {family!r} is {known} but not among the schemes run ({', '.join(schemes)})"
            )
        scheme_options.setdefault(family, {})[key] = value
    if args.out is None:
        args.out = Path("runs/extrapolate-quick" if args.quick else "runs/extrapolate")
    try:
        config = ExtrapolationConfig(
            train_len=args.train_len, eval_lengths=tuple(eval_lengths), embed_dim=args.embed_dim,
            num_heads=args.num_heads, num_layers=args.num_layers,
            train=TrainConfig(steps=steps, batch_size=batch_size, lr=args.lr, seed=seed_list[0]),
            val_fraction=args.val_fraction, max_eval_bytes=max_eval_bytes, scheme_options=scheme_options,
            convention=args.convention, backend=args.backend, eval_mode=args.eval_mode, stride=args.stride,
            min_windows=args.min_windows, windowed_eval=args.windowed_eval,
        )
    except TypeError as exc:  # pragma: no cover - argparse types guard this
        raise ValueError(str(exc)) from exc
    corpus = load_corpus(args.corpus)
    hook, write, log_through_bars = _progress_hook(args.no_progress)
    header = (
        f"relbias extrapolate: corpus {corpus.name} ({len(corpus)} bytes), schemes {', '.join(schemes)}; "
        f"seeds {','.join(map(str, seed_list))}; L = {args.train_len}, evaluated at {', '.join(map(str, eval_lengths))} "
        f"({config.eval_mode}{f', stride {config.eval_stride()}' if config.eval_stride() else ''}"
        f"{f'; full attention and window={config.eval_window()}' if config.windowed_eval else ''}); {steps} steps x "
        f"{batch_size} windows; {threads} torch thread(s); output {args.out}"
    )
    announced = False

    def announce() -> None:
        """Print the header once, when run_extrapolation has checked everything and starts its first model
        (its first progress bar, or its first result taken from a resumed file): a refused setting prints
        nothing but its error."""
        nonlocal announced
        if not announced:
            announced = True
            print(header, flush=True)

    def progress(iterable, **kwargs):
        announce()
        return hook(iterable, **kwargs)

    def report(scheme: str, entry: dict, results: dict) -> None:
        announce()
        cells = ", ".join(f"{n}: {entry['eval'][str(n)]['bpb']:.3f}" for n in eval_lengths)
        how = "from results.json" if entry.get("resumed") else (
            f"train {entry['train_seconds']:.0f} s, eval {entry['eval_seconds']:.0f} s")
        if "eval_windowed" in entry:
            scores = entry["eval_windowed"]
            cells += " | window " + ", ".join(f"{n}: {scores[str(n)]['bpb']:.3f}" for n in eval_lengths)
            cells += f", whole text: {scores[WHOLE_TEXT]['bpb']:.3f}"
            if not entry.get("resumed"):
                how += f", window eval {entry['windowed_seconds']:.0f} s"
        write(f"{scheme:>12} seed {entry['seed']}  bits per byte {cells}  ({how})")
        sys.stdout.flush()

    start = time.perf_counter()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with log_through_bars:
            _load_kernels(config.backend)  # before any bar or timer: a build is not a step's or a scheme's time
            results = run_extrapolation(
                config, schemes, corpus, args.out, seeds=seed_list, resume=args.resume, progress=progress,
                on_result=report,
            )
    except ImportError as exc:
        raise RuntimeError(str(exc)) from exc
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished schemes are kept in {args.out / 'results.json'}; rerun with --resume "
              f"to run only the others", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads_before)
    elapsed = time.perf_counter() - start
    bpb, ppl = format_table(results, metric="bpb"), format_table(results, metric="ppl")
    tokens = next(iter(results["schemes"][schemes[0]]["runs"].values()))["eval_tokens"]
    print(f"\nBits per byte on {tokens} held-out bytes (lower is better); trained at L = {args.train_len}; "
          f"{INTERVAL_NOTE}{f'; {window_note(results)}' if windowed(results) else ''}:")
    _print_table(bpb)
    print("\nPerplexity per byte:")
    _print_table(ppl)
    print(f"\n{len(schemes)} schemes x {len(seed_list)} seed(s) in {elapsed:.0f} s. Wrote {args.out / 'results.json'}, "
          f"{args.out / 'results.md'}, {args.out / 'results.png'}")
    return 0
