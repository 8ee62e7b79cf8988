"""Corpora: the default, files and folders, the errors, the split and the batches."""

from __future__ import annotations

import pytest
import torch

from relbias.experiments import load_corpus, sample_batch, split_corpus


def test_default_corpus_is_python_reference_prose_and_stable():
    first, second = load_corpus(), load_corpus()
    assert first.name == "pydoc_data.topics"
    assert len(first) > 100_000 and first.sha256 == second.sha256
    assert b"assert" in first.data and b"statement" in first.data


def test_folder_joins_files_sorted_skipping_hidden_ones(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first é", encoding="utf-8")
    (tmp_path / ".hidden").write_text("never", encoding="utf-8")
    corpus = load_corpus(tmp_path)
    assert corpus.data == "first é\n\nsecond".encode("utf-8")


def test_corpus_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text"):
        load_corpus(tmp_path / "latin1.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        load_corpus(tmp_path / "folder")


def test_split_holds_out_the_last_bytes(tmp_path):
    (tmp_path / "c.txt").write_bytes(bytes(range(100)))
    train, val = split_corpus(load_corpus(tmp_path / "c.txt"), 0.2)
    assert train.tolist() == list(range(80)) and val.tolist() == list(range(80, 100))
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        split_corpus(load_corpus(tmp_path / "c.txt"), 1.0)


def test_batches_pair_each_byte_with_the_next_one():
    tokens = torch.arange(50, dtype=torch.uint8)
    inputs, targets = sample_batch(tokens, 8, 5, torch.Generator().manual_seed(1))
    assert inputs.shape == targets.shape == (5, 8) and inputs.dtype == torch.int64
    assert torch.equal(targets, inputs + 1)  # consecutive bytes: the target is the next one
    with pytest.raises(ValueError, match="need more than 50 tokens"):
        sample_batch(tokens, 50, 1, torch.Generator())
