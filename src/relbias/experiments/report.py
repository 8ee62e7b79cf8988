"""Results of the extrapolation experiment: atomic files, a Markdown table and a plot."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

from .intervals import mean_interval

__all__ = ["write_atomic", "load_results", "summarize", "format_table", "markdown_report", "plot_results",
           "save_results", "require_matplotlib", "INTERVAL_NOTE"]

#: How the tables' intervals are computed, printed under them.
INTERVAL_NOTE = (
    "mean over seeds ± the half-width of a 95% Student-t interval on that mean (t quantile with n - 1 degrees "
    "of freedom x sample standard deviation / sqrt(n)); with one seed there is no interval"
)

RESULTS_JSON, RESULTS_MD, RESULTS_PNG = "results.json", "results.md", "results.png"


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half of one.

    Writes a temporary file in the same folder, flushes it to disk, then ``os.replace``\\ s it.
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_results(out_dir: str | Path) -> dict | None:
    """The results.json in ``out_dir``, or None when there is none.

    Raises:
        ValueError: the file exists but is not a results file of this experiment.
    """
    path = Path(out_dir) / RESULTS_JSON
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); move it away or drop --resume") from exc
    if not isinstance(results, dict) or not {"config", "schemes"} <= results.keys():
        raise ValueError(f"{path} is not a relbias extrapolate results file (no 'config'/'schemes')")
    return results


def _lengths(results: dict) -> list[int]:
    return list(results["config"]["eval_lengths"])


def summarize(runs: list[dict], lengths: list[int]) -> dict:
    """Mean and 95% Student-t interval across runs (seeds) per evaluation length and metric.

    Args:
        runs: run entries (``entry["eval"][str(n)][metric]``), one per seed, at least one.
        lengths: evaluation lengths in tokens.

    Returns:
        ``{str(n): {"nll" | "bpb" | "ppl": mean_interval(...)}}`` (:func:`~relbias.experiments.intervals.mean_interval`).
    """
    return {
        str(n): {m: mean_interval([r["eval"][str(n)][m] for r in runs]) for m in ("nll", "bpb", "ppl")}
        for n in lengths
    }


def _header(results: dict) -> list[str]:
    train_len = results["config"]["train_len"]
    cells = []
    for n in _lengths(results):
        ratio = n / train_len
        tag = f"{ratio:g}L" if ratio != 1 else "L"
        cells.append(f"{n} ({tag})")
    return cells


def _finished(results: dict) -> list[tuple[str, dict]]:
    """(scheme, block) in run order, for schemes with at least one finished run."""
    out = []
    for name in results.get("order", sorted(results["schemes"])):
        block = results["schemes"].get(name)
        if block is not None and block.get("runs"):
            out.append((name, block))
    return out


def _cell(stat: dict, digits: int) -> str:
    if stat["half_width"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['half_width']:.{digits}f}"


def format_table(results: dict, *, metric: str = "bpb") -> list[list[str]]:
    """Rows of strings: a header, then one row per scheme with a finished run (in run order).

    Each cell is the mean across the scheme's finished seeds ± the half-width of its 95% Student-t interval
    (:data:`INTERVAL_NOTE`); the mean alone with one seed. The "seeds" column counts the runs averaged.

    Args:
        results: as in results.json (version 2).
        metric: "bpb" (bits per byte, 3 decimals) or "ppl" (perplexity per byte, 2 decimals).
    """
    digits = 3 if metric == "bpb" else 2
    rows = [["scheme", "seeds", *_header(results)]]
    for name, block in _finished(results):
        summary = block["summary"]
        rows.append([name, str(len(block["runs"])), *(_cell(summary[str(n)][metric], digits) for n in _lengths(results))])
    return rows


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _evaluation(c: dict) -> str:
    if c.get("eval_mode", "nonoverlapping") == "sliding":
        return f"sliding windows of each length, stride {c['stride']} (each byte scored once)"
    return "non-overlapping windows of each length"


def markdown_report(results: dict) -> str:
    """results.md: the setup in one paragraph, bits per byte and perplexity tables with intervals, timings."""
    c = results["config"]
    finished = _finished(results)
    tokens = next(iter(finished[0][1]["runs"].values()))["eval_tokens"] if finished else 0
    lines = [
        "# relbias extrapolate",
        "",
        f"Byte-level decoder LMs ({c['num_layers']} layers, width {c['embed_dim']}, {c['num_heads']} heads) trained "
        f"for {c['steps']} steps of {c['batch_size']} windows at length L = {c['train_len']} bytes on "
        f"`{c['corpus']}` ({c['corpus_bytes']} bytes, last {c['val_fraction']:g} held out), seeds "
        f"{', '.join(map(str, results.get('seeds', [])))}. Evaluated on the same {tokens} held-out bytes in "
        f"{_evaluation(c)}. Cells: {INTERVAL_NOTE}.",
        "",
        "## Bits per byte (lower is better)",
        "",
        _markdown(format_table(results, metric="bpb")),
        "",
        "## Perplexity per byte",
        "",
        _markdown(format_table(results, metric="ppl")),
        "",
        "## Runs",
        "",
        "| scheme | seed | options | parameters | train s | eval s | final train loss (nats) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, block in finished:
        for seed, e in block["runs"].items():
            lines.append(
                f"| {name} | {seed} | {_options(e.get('position_options', {}))} | {e['parameters']} | "
                f"{e['train_seconds']:.1f} | {e['eval_seconds']:.1f} | {e['final_train_loss']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def _options(options: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items()) or "-"


def require_matplotlib() -> None:
    """Raise now if the plot cannot be drawn, rather than after training.

    Raises:
        ImportError: matplotlib is not installed (it comes with ``pip install relbias[cli]``).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("the plot needs matplotlib: pip install 'relbias[cli]'") from exc


def plot_results(results: dict) -> bytes:
    """PNG bytes: bits per byte vs evaluation length (log 2 axis), one line per scheme (the mean across seeds)
    with its 95% interval as a shaded band (none with one seed), L marked.

    Raises:
        ImportError: matplotlib is missing.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    lengths = _lengths(results)
    fig = Figure(figsize=(7.6, 4.2), dpi=100)
    ax = fig.add_subplot()
    for name, block in _finished(results):
        stats = [block["summary"][str(n)]["bpb"] for n in lengths]
        (line,) = ax.plot(lengths, [s["mean"] for s in stats], marker="o", markersize=3, label=name)
        if stats[0]["half_width"] is not None:
            ax.fill_between(lengths, [s["low"] for s in stats], [s["high"] for s in stats], color=line.get_color(),
                            alpha=0.2, linewidth=0)
    ax.axvline(results["config"]["train_len"], color="grey", linestyle="--", linewidth=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (bytes)")
    ax.set_ylabel("bits per byte (lower is better)")
    seeds = len(results.get("seeds", [])) or 1
    band = f", 95% interval over {seeds} seeds" if seeds > 1 else ", 1 seed"
    ax.set_title(f"Length extrapolation on {Path(results['config']['corpus']).name}{band}", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, off the lines
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def save_results(out_dir: str | Path, results: dict) -> None:
    """Write results.md, results.png and results.json into ``out_dir`` (created if needed), each atomically.

    results.json, the record ``--resume`` reads, is replaced last: when it lists a scheme, results.md and
    results.png already show it, whenever the process is killed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown, png, text = markdown_report(results), plot_results(results), json.dumps(results, indent=2) + "\n"
    write_atomic(out / RESULTS_MD, markdown)
    write_atomic(out / RESULTS_PNG, png)
    write_atomic(out / RESULTS_JSON, text)
