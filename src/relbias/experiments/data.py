"""Corpora as bytes: the default (Python's own reference prose), a file or a folder; splits and batches."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "default_corpus_text", "split_corpus", "sample_batch"]

#: Name recorded for the default corpus.
DEFAULT_CORPUS = "pydoc_data.topics"


@dataclass(frozen=True)
class Corpus:
    """A text corpus as UTF-8 bytes.

    Attributes:
        name: ``"pydoc_data.topics"`` or the path it was read from.
        data: the UTF-8 bytes (one token per byte).
        sha256: hex digest of ``data``, recorded with results so a resumed run can tell corpora apart.
    """

    name: str
    data: bytes

    @property
    def sha256(self) -> str:
        """Hex SHA-256 digest of :attr:`data` (64 characters)."""
        return hashlib.sha256(self.data).hexdigest()

    def __len__(self) -> int:
        """Size in bytes (= tokens)."""
        return len(self.data)


def default_corpus_text() -> str:
    """The English reference prose shipped with every CPython: ``pydoc_data.topics`` (about 0.47 MB).

    These are the help texts of ``help('assert')``, ``help('if')`` ... (the Python Language Reference),
    joined in sorted topic order, so the corpus is the same on every run of one Python version.

    Raises:
        FileNotFoundError: this Python was built without ``pydoc_data`` (some minimal distributions).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # pragma: no cover - depends on the Python build
        raise FileNotFoundError(
            "the default corpus pydoc_data.topics is missing from this Python; pass --corpus PATH"
        ) from exc
    return "\n\n".join(topics[name] for name in sorted(topics))


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"corpus file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def load_corpus(path: str | Path | None = None) -> Corpus:
    """Read a corpus: the default reference prose, one UTF-8 text file, or every file of a folder.

    Args:
        path: None for :func:`default_corpus_text`; a file; or a folder, whose regular files (recursively,
            sorted by path, hidden names starting with "." skipped) are joined with blank lines.

    Returns:
        :class:`Corpus` of the UTF-8 bytes.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a file that is not UTF-8; an empty corpus (no bytes, or a folder without files).
    """
    if path is None:
        return Corpus(DEFAULT_CORPUS, default_corpus_text().encode("utf-8"))
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} does not exist; pass a UTF-8 text file or a folder of them")
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"corpus folder {path} holds no files")
        text = "\n\n".join(_read_utf8(p) for p in files)
    else:
        text = _read_utf8(path)
    data = text.encode("utf-8")
    if not data.strip():
        raise ValueError(f"corpus {path} is empty; it needs text to train on")
    return Corpus(str(path), data)


def split_corpus(corpus: Corpus, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split into a training part (the first bytes) and a held-out validation part (the last bytes).

    Args:
        corpus: the corpus.
        val_fraction: share of the bytes held out, in (0, 1).

    Returns:
        (train, val): uint8 tensors of byte values, ``len(train) + len(val) == len(corpus)``.

    Raises:
        ValueError: ``val_fraction`` outside (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def sample_batch(
    tokens: torch.Tensor, length: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows for next-byte prediction.

    Args:
        tokens: uint8 (N,) byte values, N > ``length``.
        length: window length L in tokens.
        batch_size: B.
        generator: source of the window starts (seeded for reproducibility).

    Returns:
        (inputs, targets): int64 (B, L) each; ``targets[:, t]`` is the byte after ``inputs[:, t]``.

    Raises:
        ValueError: ``len(tokens) <= length``.
    """
    if len(tokens) <= length:
        raise ValueError(f"need more than {length} tokens to draw windows of length {length}, got {len(tokens)}")
    starts = torch.randint(0, len(tokens) - length, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + length + 1] for s in starts.tolist()]).long()  # (B, L + 1)
    return windows[:, :-1], windows[:, 1:]
