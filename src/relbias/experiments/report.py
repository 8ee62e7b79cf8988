"""Results of the extrapolation experiment: atomic files, a Markdown table and a plot."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

from .intervals import mean_interval

__all__ = ["write_atomic", "load_results", "summarize", "format_table", "markdown_report", "plot_results",
           "save_results", "require_matplotlib", "windowed", "window_note", "INTERVAL_NOTE", "WHOLE_TEXT"]

#: How the tables' intervals are computed, printed under them.
INTERVAL_NOTE = (
    "mean over seeds ± the half-width of a 95% Student-t interval on that mean (t quantile with n - 1 degrees "
    "of freedom x sample standard deviation / sqrt(n)); with one seed there is no interval"
)

RESULTS_JSON, RESULTS_MD, RESULTS_PNG = "results.json", "results.md", "results.png"

#: Key of the windowed score of the whole scored text in one forward, beside the evaluation lengths.
WHOLE_TEXT = "whole_text"


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


def summarize(runs: list[dict], lengths: list[int | str], *, field: str = "eval") -> dict:
    """Mean and 95% Student-t interval across runs (seeds) per evaluation length and metric.

    Args:
        runs: run entries (``entry[field][str(n)][metric]``), one per seed, at least one.
        lengths: evaluation lengths in tokens (and other keys of ``entry[field]``, e.g. :data:`WHOLE_TEXT`).
        field: "eval" (full attention, default) or "eval_windowed".

    Returns:
        ``{str(n): {"nll" | "bpb" | "ppl": mean_interval(...)}}`` (:func:`~relbias.experiments.intervals.mean_interval`).
    """
    return {
        str(n): {m: mean_interval([r[field][str(n)][m] for r in runs]) for m in ("nll", "bpb", "ppl")}
        for n in lengths
    }


def windowed(results: dict) -> bool:
    """Whether ``results`` holds the windowed evaluation (``config["eval_window"]``) beside full attention."""
    return results["config"].get("eval_window") is not None


def window_note(results: dict) -> str:
    """What the "window" rows and the "whole text" column mean, in one sentence, for the tables."""
    left = results["config"]["eval_window"][0]
    return (
        f"\"window\" rows: every attention layer limited to window=({left}, 0), each byte seeing itself and at most "
        f"{left} earlier bytes (L - 1) at every length; \"whole text\": the same scored bytes in one windowed "
        f"forward, every byte after the first {left} with a full window of {left + 1} bytes at every layer"
    )


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

    With the windowed evaluation (:func:`windowed`), each scheme has two rows side by side, "full" attention and
    "window" (attention limited to the training length), an "attention" column names them, and a last column
    "whole text" holds the windowed score of the whole scored text in one forward ("-" for full attention, which
    is not run over the whole text: it would cost O(N²)).

    Args:
        results: as in results.json (version 2).
        metric: "bpb" (bits per byte, 3 decimals) or "ppl" (perplexity per byte, 2 decimals).
    """
    digits = 3 if metric == "bpb" else 2
    lengths = _lengths(results)
    if not windowed(results):
        rows = [["scheme", "seeds", *_header(results)]]
        for name, block in _finished(results):
            summary = block["summary"]
            rows.append([name, str(len(block["runs"])), *(_cell(summary[str(n)][metric], digits) for n in lengths)])
        return rows
    rows = [["scheme", "attention", "seeds", *_header(results), "whole text"]]
    for name, block in _finished(results):
        seeds = str(len(block["runs"]))
        full, window = block["summary"], block["summary_windowed"]
        rows.append([name, "full", seeds, *(_cell(full[str(n)][metric], digits) for n in lengths), "-"])
        rows.append([name, "window", seeds, *(_cell(window[str(n)][metric], digits) for n in [*lengths, WHOLE_TEXT])])
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
    window_seconds = windowed(results)
    lines = [
        "# relbias extrapolate",
        "",
        f"Byte-level decoder LMs ({c['num_layers']} layers, width {c['embed_dim']}, {c['num_heads']} heads) trained "
        f"for {c['steps']} steps of {c['batch_size']} windows at length L = {c['train_len']} bytes on "
        f"`{c['corpus']}` ({c['corpus_bytes']} bytes, last {c['val_fraction']:g} held out), seeds "
        f"{', '.join(map(str, results.get('seeds', [])))}. Evaluated on the same {tokens} held-out bytes in "
        f"{_evaluation(c)}. Cells: {INTERVAL_NOTE}." + (f" {window_note(results)}." if windowed(results) else ""),
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
        "| scheme | seed | options | parameters | train s | eval s |" + (" window eval s |" if window_seconds else "")
        + " final train loss (nats) |",
        "|---|---|---|---|---|---|" + ("---|" if window_seconds else "") + "---|",
    ]
    for name, block in finished:
        for seed, e in block["runs"].items():
            extra = f" {e['windowed_seconds']:.1f} |" if window_seconds else ""
            lines.append(
                f"| {name} | {seed} | {_options(e.get('position_options', {}))} | {e['parameters']} | "
                f"{e['train_seconds']:.1f} | {e['eval_seconds']:.1f} |{extra} {e['final_train_loss']:.3f} |"
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
    with its 95% interval as a shaded band (none with one seed), L marked. With the windowed evaluation
    (:func:`windowed`), two panels side by side on one y axis: full attention on the left, attention limited to
    the training length on the right, each scheme in the same colour in both.

    Raises:
        ImportError: matplotlib is missing.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    lengths = _lengths(results)
    train_len = results["config"]["train_len"]
    panels = [("summary", "full attention")]
    if windowed(results):
        left = results["config"]["eval_window"][0]
        panels.append(("summary_windowed", f"attention within L: window=({left}, 0)"))
    fig = Figure(figsize=(7.6 + 4.4 * (len(panels) - 1), 4.2), dpi=100)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (key, label) in zip(axes, panels):
        for k, (name, block) in enumerate(_finished(results)):
            stats = [block[key][str(n)]["bpb"] for n in lengths]
            (line,) = ax.plot(lengths, [s["mean"] for s in stats], marker="o", markersize=3, label=name,
                              color=f"C{k % 10}")
            if stats[0]["half_width"] is not None:
                ax.fill_between(lengths, [s["low"] for s in stats], [s["high"] for s in stats],
                                color=line.get_color(), alpha=0.2, linewidth=0)
        ax.axvline(train_len, color="grey", linestyle="--", linewidth=1, label="training length")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("evaluation length (bytes)")
        ax.grid(True, alpha=0.3)
        if len(panels) > 1:
            ax.set_title(label, fontsize="medium")
    axes[0].set_ylabel("bits per byte (lower is better)")
    seeds = len(results.get("seeds", [])) or 1
    band = f", 95% interval over {seeds} seeds" if seeds > 1 else ", 1 seed"
    title = f"Length extrapolation on {Path(results['config']['corpus']).name}{band}"
    if len(panels) > 1:
        fig.suptitle(title, fontsize="medium")
    else:
        axes[0].set_title(title, fontsize="medium")
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, off the lines
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
