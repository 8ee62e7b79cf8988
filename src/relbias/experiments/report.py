"""Results of the extrapolation experiment: atomic files, a Markdown table and a plot."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic", "load_results", "format_table", "markdown_report", "plot_results", "save_results",
           "require_matplotlib"]

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


def _header(results: dict) -> list[str]:
    train_len = results["config"]["train_len"]
    cells = []
    for n in _lengths(results):
        ratio = n / train_len
        tag = f"{ratio:g}L" if ratio != 1 else "L"
        cells.append(f"{n} ({tag})")
    return cells


def format_table(results: dict, *, metric: str = "bpb") -> list[list[str]]:
    """Rows of strings: a header, then one row per finished scheme (in run order).

    Args:
        results: as in results.json.
        metric: "bpb" (bits per byte, 3 decimals) or "ppl" (perplexity per byte, 2 decimals).
    """
    rows = [["scheme", *_header(results)]]
    for name in results.get("order", sorted(results["schemes"])):
        entry = results["schemes"].get(name)
        if entry is None:
            continue
        digits = 3 if metric == "bpb" else 2
        rows.append([name, *(f"{entry['eval'][str(n)][metric]:.{digits}f}" for n in _lengths(results))])
    return rows


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    """results.md: the setup in one paragraph, bits per byte and perplexity tables, timings."""
    c = results["config"]
    lines = [
        "# relbias extrapolate",
        "",
        f"Byte-level decoder LMs ({c['num_layers']} layers, width {c['embed_dim']}, {c['num_heads']} heads) trained "
        f"for {c['steps']} steps of {c['batch_size']} windows at length L = {c['train_len']} bytes on "
        f"`{c['corpus']}` ({c['corpus_bytes']} bytes, last {c['val_fraction']:g} held out), seed {c['seed']}. "
        f"Evaluated on the same {next(iter(results['schemes'].values()))['eval_tokens'] if results['schemes'] else 0} "
        f"held-out bytes in non-overlapping windows of each length.",
        "",
        "## Bits per byte (lower is better)",
        "",
        _markdown(format_table(results, metric="bpb")),
        "",
        "## Perplexity per byte",
        "",
        _markdown(format_table(results, metric="ppl")),
        "",
        "## Timings",
        "",
        "| scheme | options | parameters | train s | eval s | final train loss (nats) |",
        "|---|---|---|---|---|---|",
    ]
    for name in results.get("order", sorted(results["schemes"])):
        e = results["schemes"].get(name)
        if e is not None:
            lines.append(
                f"| {name} | {_options(e.get('position_options', {}))} | {e['parameters']} | {e['train_seconds']:.1f} | {e['eval_seconds']:.1f} | "
                f"{e['final_train_loss']:.3f} |"
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
    """PNG bytes: bits per byte vs evaluation length (log 2 axis), one line per scheme, L marked.

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
    for name in results.get("order", sorted(results["schemes"])):
        entry = results["schemes"].get(name)
        if entry is not None:
            ax.plot(lengths, [entry["eval"][str(n)]["bpb"] for n in lengths], marker="o", label=name)
    ax.axvline(results["config"]["train_len"], color="grey", linestyle="--", linewidth=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (bytes)")
    ax.set_ylabel("bits per byte (lower is better)")
    ax.set_title(f"Length extrapolation on {Path(results['config']['corpus']).name}")
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
