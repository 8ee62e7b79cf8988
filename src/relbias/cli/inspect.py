"""``relbias inspect``: how one bias family, or one saved T5 table, treats distance.

For a family and its settings (``--family``), or for a T5 bias table in a state_dict / safetensors file
(``--state``), prints the bucket map where there is one (:func:`relbias.t5_bucket_ranges`), the number of
learnable scalars, the family's own constants (ALiBi slopes, KERPLE r1/r2, FIRE c and L, ...), and which
(query, key) pairs read the same parameter (:meth:`relbias.RelativeBias.pairs_sharing`); writes two PNG
plots: bias vs offset (one line per head, one panel per head beyond 4, or only ``--head``; past T5's last
bucket; a fresh learnable family titled as a random initialisation) and the (Lq, Lk) bias heatmap per head. ``--json`` prints
the same, machine-readable. Plots need matplotlib (the ``cli`` extra). Offsets are ``i - j``, query minus
key position, in tokens (docs/conventions.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import torch

from .buckets import format_range as _fmt
from ..biases import FAMILIES, RelativeBias, make_bias
from ..integrations.loading import t5_bias_from_file

__all__ = ["register", "run", "describe", "bias_vs_offset"]

_DPI = 100
_MISSING_MATPLOTLIB = (
    "plots need matplotlib, an optional extra: pip install 'relbias[cli]' (or pass --no-plots for the text only)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    p = subparsers.add_parser(
        "inspect",
        help="show how a bias family (or a saved T5 table) treats distance: bucket map, parameters, plots",
        description=re.sub(r":\w+:`([^`]+)`|``([^`]+)``", lambda m: m.group(1) or m.group(2), __doc__.split("\n\n")[1]),
        epilog=(
            "A fresh learnable family shows its initialisation (--seed). Examples: relbias inspect --family alibi "
            "--num-heads 8 --causal --out-dir plots; relbias inspect --state model.safetensors --stack decoder"
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--family", help=f"bias family: {', '.join(sorted(FAMILIES))} ('none' = NoPE)")
    source.add_argument("--state", metavar="FILE", help="state_dict (.pt/.bin) or .safetensors file with a T5 table")
    p.add_argument("--key", help="tensor in --state to read as a (num_buckets, num_heads) table")
    p.add_argument("--stack", choices=("encoder", "decoder"), help="Hugging Face table to read (default: encoder)")
    p.add_argument("--num-heads", type=int, help="heads H (default 8; a --state table sets its own)")
    p.add_argument("--max-len", type=int, default=64, help="sequence length L of the plots and pairs (default 64)")
    p.add_argument("--num-buckets", type=int, help="T5 buckets (t5 family; default 32)")
    p.add_argument("--max-distance", type=int, help="T5 max_distance in tokens (default 128)")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--causal", action="store_true", help="causal (decoder) form")
    direction.add_argument("--bidirectional", action="store_true", help="bidirectional (encoder) form")
    p.add_argument("--head", type=int, help="plot this head only (default: every head, one panel each beyond 4)")
    p.add_argument("--pair", type=int, nargs=2, metavar=("QUERY", "KEY"), help="pair to find sharers of (default L-1, L//2)")
    p.add_argument("--seed", type=int, default=0, help="seed of a fresh family's initialisation (default 0)")
    p.add_argument("--out-dir", default=".", help="folder for the PNG plots (default: current folder)")
    p.add_argument("--width", type=int, default=800, help="plot width in pixels (default 800)")
    p.add_argument("--height", type=int, default=600, help="plot height in pixels (default 600)")
    p.add_argument("--no-plots", action="store_true", help="print only, write no PNG")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- what to show


def bias_vs_offset(bias: RelativeBias | None, offsets: torch.Tensor, query_position: int, num_heads: int) -> torch.Tensor:
    """Bias of each head at each offset: float (H, n) for int64 offsets (n,), logits.

    An offset-only family reads :meth:`RelativeBias.offset_values`; one that also reads the query position
    (FIRE) is evaluated for the query at ``query_position`` and keys at ``query_position - offset``. ``None``
    (NoPE) is zero everywhere, with ``num_heads`` rows.
    """
    if bias is None:
        return torch.zeros(num_heads, offsets.numel())
    with torch.no_grad():
        if bias.offset_only:
            return bias.offset_values(offsets).float()
        query = torch.tensor([query_position])
        return bias.pair_values(query, query - offsets)[:, 0].float()


def _pairs_sharing(bias: RelativeBias | None, query: int, key: int, length: int, causal: bool) -> torch.Tensor:
    if bias is not None:
        return bias.pairs_sharing(query, key, length)
    for name, value in (("query", query), ("key", key)):  # NoPE: every visible pair reads the same 0
        if not 0 <= value < length:
            raise ValueError(f"{name} must be a position in [0, {length}), got {value}")
    grid = torch.ones(length, length, dtype=torch.bool)
    return (grid.tril() if causal else grid).nonzero()


def _check_args(args: argparse.Namespace) -> None:
    for name in ("max_len", "width", "height"):
        value = getattr(args, name)
        low = 16 if name != "max_len" else 1
        if value < low or (name != "max_len" and value > 10000):
            limit = f"in [{low}, 10000] pixels" if name != "max_len" else ">= 1 token"
            raise ValueError(f"--{name.replace('_', '-')} must be {limit}, got {value}")
    if args.num_heads is not None and args.num_heads < 1:
        raise ValueError(f"--num-heads must be >= 1, got {args.num_heads}")
    if args.head is not None and args.head < 0:
        raise ValueError(f"--head must be >= 0, got {args.head}")
    if args.family is not None:
        for name in ("key", "stack"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name} reads a --state file; it does not apply to --family")
        if args.family != "t5":
            for name in ("num_buckets", "max_distance"):
                if getattr(args, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} applies to the t5 family only, not {args.family!r}")


_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _condensed_load_error(exc: ValueError, path: str) -> str:
    """torch.load(weights_only=True)'s refusal (a paragraph of advice) as one actionable line; other errors as
    they are. The class it refused is named in the original error, the exception's context."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return text
    found = _UNSUPPORTED_GLOBAL.search(f"{text} {exc.__context__}")
    if found is None:  # not a refused class (e.g. no pickle at all): torch's first line says what went wrong
        return text.splitlines()[0]
    what = f"a pickled {found.group(1)}"
    return (f"could not read {path}: it holds {what}, which torch.load(weights_only=True) will not run; if you "
            f"trust the file, re-save only its tensors (torch.save(model.state_dict(), ...)) or pass a .safetensors file")


def _build(args: argparse.Namespace) -> tuple[RelativeBias | None, dict[str, object], int, bool]:
    """The bias, a description of its source, H, and whether it is causal."""
    if args.state is not None:
        bidirectional = True if args.bidirectional else False if args.causal else None
        try:
            bias, where = t5_bias_from_file(
                args.state, key=args.key, stack=args.stack, bidirectional=bidirectional,
                max_distance=args.max_distance if args.max_distance is not None else 128,
            )
        except ImportError as exc:  # no safetensors: a clear message and exit status 2, as for other errors
            raise RuntimeError(str(exc)) from None
        except ValueError as exc:
            raise ValueError(_condensed_load_error(exc, args.state)) from None
        for name, value, actual in (("num-heads", args.num_heads, bias.num_heads), ("num-buckets", args.num_buckets, bias.num_buckets)):
            if value is not None and value != actual:
                raise ValueError(f"--{name} {value} does not match the table in {args.state}, which has {actual}")
        return bias, {"file": args.state, "key": where}, bias.num_heads, not bias.bidirectional
    num_heads = args.num_heads if args.num_heads is not None else 8
    options = {}
    if args.family == "t5":
        options = {"num_buckets": args.num_buckets or 32, "max_distance": args.max_distance or 128}
    torch.manual_seed(args.seed)
    bias = make_bias(args.family, num_heads=num_heads, max_len=args.max_len, bidirectional=not args.causal, **options)
    return bias, {"family": args.family}, num_heads, args.causal


def describe(args: argparse.Namespace) -> tuple[dict[str, object], torch.Tensor, torch.Tensor]:
    """Everything ``inspect`` reports, JSON-ready, plus the curves and heatmaps to plot.

    The bias comes from :func:`relbias.biases.make_bias` (``args.family``, any registered family) or from
    :func:`relbias.integrations.loading.t5_bias_from_file` (``args.state``); what is reported comes from its
    contract: :attr:`relbias.RelativeBias.num_parameters`, :meth:`relbias.RelativeBias.describe` (the
    ``"constants"``), :meth:`relbias.RelativeBias.pairs_sharing`, and ``bucket_ranges()`` where the family has
    one.

    Args:
        args: the parsed ``inspect`` arguments (see :func:`register`).

    Returns:
        ``(info, curves, heatmaps)``: the JSON-ready report; float32 (H, n) bias of each head at the n offsets of
        ``info["bias_vs_offset"]["offsets"]``; float32 (H, L, L) bias of every pair, NaN at masked (future) keys
        when causal (L = ``args.max_len``).

    Raises:
        ValueError, FileNotFoundError, RuntimeError: bad settings or files (the CLI prints them, exit status 2).
    """
    _check_args(args)
    bias, source, num_heads, causal = _build(args)
    if args.head is not None and args.head >= num_heads:
        raise ValueError(f"--head {args.head} is not a head of this bias, which has {num_heads} (0 .. {num_heads - 1})")
    length = args.max_len
    query, key = args.pair if args.pair is not None else (length - 1, length // 2)
    bucket_ranges = getattr(bias, "bucket_ranges", None)  # a family that buckets offsets lists them (T5Bias)
    ranges = bucket_ranges() if bucket_ranges is not None else []
    # the last bucket starts at the largest finite end; show past it, so that every bucket is on the curve
    saturation = max((abs(v) for _, lo, hi in ranges for v in (lo, hi) if v is not None), default=0)
    reach = max(length - 1, saturation + max(4, saturation // 5) if ranges else 0)
    offsets = torch.arange(0 if causal else -reach, reach + 1)
    curves = bias_vs_offset(bias, offsets, length - 1, num_heads)
    with torch.no_grad():
        heatmaps = bias(length, length).float() if bias is not None else torch.zeros(num_heads, length, length)
    heatmaps = heatmaps.expand(num_heads, length, length).clone()
    if causal:
        heatmaps.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), float("nan"))  # masked keys
    pairs = _pairs_sharing(bias, query, key, length, causal)
    if bias is None or bias.num_parameters == 0:
        values = "fixed (no learnable parameters)"
    elif args.state is not None:
        values = "learned (read from the file)"
    else:
        values = f"random initialisation (seed {args.seed}), not learned values"
    info: dict[str, object] = {
        "source": source,
        "family": args.family if args.family is not None else "t5",
        "class": type(bias).__name__ if bias is not None else None,
        "num_heads": num_heads,
        "bidirectional": not causal,
        "default_convention": bias.default_convention if bias is not None else None,
        "offset_only": bias.offset_only if bias is not None else True,
        "parameter_count": bias.num_parameters if bias is not None else 0,
        "values": values,
        "constants": bias.describe() if bias is not None else {},
        "bucket_map": None,
        "pairs_sharing": {"query": query, "key": key, "length": length, "count": len(pairs), "pairs": pairs.tolist()},
        "bias_vs_offset": {"query_position": length - 1, "offsets": offsets.tolist(), "values": curves.tolist(),
                           "saturation_offset": saturation if ranges else None},
        "plots": {},
    }
    if bucket_ranges is not None:
        info["bucket_map"] = [{"bucket": b, "lowest_offset": lo, "highest_offset": hi} for b, lo, hi in ranges]
    return info, curves, heatmaps


# ---------------------------------------------------------------- plots and printing


def _per_head(value: object) -> str:
    """A per-head constant in a legend: exact powers of two as 1/2^k fractions (ALiBi's slopes), else 3 digits."""
    if isinstance(value, float) and 0 < value < 1 and (1 / value).is_integer() and (int(1 / value) & (int(1 / value) - 1)) == 0:
        return f"1/{int(1 / value)}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _head_labels(info: dict[str, object]) -> list[str]:
    """``head h`` and the family's per-head constants (ALiBi slopes, KERPLE r1 and r2): lists of H values."""
    heads = info["num_heads"]
    per_head = {k: v for k, v in info["constants"].items() if isinstance(v, (list, tuple)) and len(v) == heads}
    names = {"slopes": "slope"}
    return [", ".join([f"head {h}"] + [f"{names.get(k, k)} {_per_head(v[h])}" for k, v in per_head.items()])
            for h in range(heads)]


def _plot(info: dict[str, object], curves: torch.Tensor, heatmaps: torch.Tensor, args: argparse.Namespace) -> dict[str, str]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError(_MISSING_MATPLOTLIB) from None
    os.makedirs(args.out_dir, exist_ok=True)
    name = info["family"] if args.family is not None else "t5_table"
    size = (args.width / _DPI, args.height / _DPI)
    title = f"{info['class'] or 'NoPE (no position bias)'}, {'bidirectional' if info['bidirectional'] else 'causal'}"
    if info["values"].startswith("random"):
        title += f": {info['values']}"
    paths = {"bias_vs_offset": os.path.join(args.out_dir, f"{name}_bias_vs_offset.png"),
             "heatmap": os.path.join(args.out_dir, f"{name}_heatmap.png")}
    labels = _head_labels(info)
    heads = [args.head] if args.head is not None else list(range(curves.shape[0]))
    length = heatmaps.shape[1]
    saturation = info["bias_vs_offset"]["saturation_offset"]

    fig = Figure(figsize=size, dpi=_DPI, layout="constrained")  # titles and colour bar never overlap
    offsets = info["bias_vs_offset"]["offsets"]
    panels = len(heads) > 4  # beyond 4 heads one line each is unreadable: one panel per head, shared axes
    cols = math.ceil(math.sqrt(len(heads))) if panels else 1
    rows = math.ceil(len(heads) / cols) if panels else 1
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True).ravel()
    for i, h in enumerate(heads):
        ax = axes[i] if panels else axes[0]
        ax.plot(offsets, curves[h].tolist(), label=labels[h])
        if panels:
            ax.set_title(labels[h], fontsize="x-small")
            ax.tick_params(labelsize="xx-small")
    for ax in axes[len(heads):] if panels else ():
        ax.set_axis_off()
    for ax in axes[: len(heads) if panels else 1]:
        marks = [(length - 1, "grey", ":")] + ([(saturation, "tab:red", "--")] if saturation else [])
        for at, colour, style in marks:
            for x in ([at] if not info["bidirectional"] else [-at, at]):
                ax.axvline(x, color=colour, linestyle=style, linewidth=0.8)
    where = "" if info["offset_only"] else f" (query at position {info['bias_vs_offset']['query_position']})"
    notes = f"dotted: |offset| = L - 1 = {length - 1}" + (f"; dashed: last bucket from |offset| = {saturation}" if saturation else "")
    wide = args.width >= 500  # the marks' note and a legend need room; a small figure keeps the curves only
    fig.supxlabel(f"offset i - j (tokens; > 0: key in the past)" + (f". {notes}" if wide else ""), fontsize="x-small")
    fig.supylabel("bias (logits)", fontsize="small")
    fig.suptitle(title + where, fontsize="small")
    if not panels and (wide or len(heads) == 1):
        axes[0].legend(fontsize="x-small", ncol=2 if len(heads) > 2 else 1)
    fig.savefig(paths["bias_vs_offset"], dpi=_DPI)

    cols = math.ceil(math.sqrt(len(heads)))
    rows = math.ceil(len(heads) / cols)
    fig = Figure(figsize=size, dpi=_DPI, layout="constrained")  # titles and colour bar never overlap
    axes = fig.subplots(rows, cols, squeeze=False)
    chosen = heatmaps[heads]
    shown = chosen[~chosen.isnan()]  # masked (future) keys are NaN: left blank, out of the colour range
    low, high = float(shown.min()), float(shown.max())
    for i, ax in enumerate(axes.flat):
        if i >= len(heads):
            ax.set_axis_off()
            continue
        image = ax.imshow(chosen[i].numpy(), vmin=low, vmax=high, cmap="viridis", interpolation="nearest")
        ax.set_title(labels[heads[i]], fontsize="x-small")
        ax.tick_params(labelsize="xx-small")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="bias (logits)")
    fig.suptitle(f"{title}: (query, key) bias, L = {length}; rows queries, columns keys", fontsize="small")
    fig.savefig(paths["heatmap"], dpi=_DPI)
    return paths


def _shown(value: object) -> str:
    """A constant of :meth:`relbias.RelativeBias.describe` as text: floats to 4 significant digits."""
    if isinstance(value, (list, tuple)):
        return ", ".join(_shown(v) for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _print_text(info: dict[str, object], args: argparse.Namespace) -> None:
    source = info["source"]
    origin = f"file {source['file']}, tensor {source['key']}" if "file" in source else f"family {source['family']}"
    print(f"{origin}: {info['class'] or 'NoPE, no position bias'}, {info['num_heads']} heads, "
          f"{'bidirectional' if info['bidirectional'] else 'causal'}"
          + (f", score convention {info['default_convention']!r}" if info["default_convention"] else ""))
    print(f"learnable parameters: {info['parameter_count']}; values: {info['values']}")
    for name, value in info["constants"].items():
        print(f"  {name}: {_shown(value)}")
    if info["bucket_map"] is not None:
        print("bucket map (offsets i - j, query minus key position):")
        for entry in info["bucket_map"]:
            print(f"  {entry['bucket']:4d}  {_fmt(entry['lowest_offset'], entry['highest_offset'])}")
    elif info["class"] is None:
        print("bucket map: none (no position bias: every pair gets 0)")
    else:
        print("bucket map: none (the bias is a function of the offset" + ("" if info["offset_only"] else " and the query position") + ")")
    share = info["pairs_sharing"]
    pairs = " ".join(f"({q},{k})" for q, k in share["pairs"][:12]) + (" ..." if share["count"] > 12 else "")
    print(f"pairs (query, key) sharing the parameter (or function value) of ({share['query']},{share['key']}) in a "
          f"{share['length']}-token sequence: {share['count']}: {pairs}")
    for kind, path in info["plots"].items():
        print(f"wrote {path} ({args.width}x{args.height} px, {kind.replace('_', ' ')})")


def run(args: argparse.Namespace) -> int:
    """Print the report (text or ``--json``) and write the plots unless ``--no-plots``."""
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401  (fail before any work when the extra is missing)
        except ImportError:
            raise RuntimeError(_MISSING_MATPLOTLIB) from None
    info, curves, heatmaps = describe(args)
    if not args.no_plots:
        info["plots"] = _plot(info, curves, heatmaps, args)
    if args.json:
        print(json.dumps(info))
    else:
        _print_text(info, args)
    return 0
