"""Hostile arguments to every ``relbias`` subcommand: one clear error line, exit status 2, no traceback,
no output written (issue 7). argparse errors exit with SystemExit(2) and its usage line."""

from __future__ import annotations

import pytest

from relbias.cli.main import main


def _fails(argv, capsys) -> str:
    """Run ``relbias argv``; assert exit status 2 and no traceback; return stderr."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse rejected the arguments
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n", "0"], "argument --n: expected an integer >= 1, got 0"),
        (["--n", "-5"], "argument --n: expected an integer >= 1, got -5"),
        (["--n", "x"], "argument --n: expected an integer >= 1, got 'x'"),
        (["--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
        (["--heads", "0"], "argument --heads: expected an integer >= 1, got 0"),
        (["--head-dim", "0"], "argument --head-dim: expected an integer >= 1, got 0"),
        (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
        (["--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
        (["--max-scores", "nan"], "argument --max-scores: expected a number >= 0, got 'nan'"),
        (["--max-scores", "-1"], "argument --max-scores: expected a number >= 0, got '-1'"),
        (["--family", "rope", "--n", "8", "--no-memory", "--repeats", "1", "--methods", "blockwise"],
         "relbias bench: error: argument --family: invalid choice: 'rope'"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ],
)
def test_bench_rejects_bad_sizes_before_measuring(args, message, capsys):
    # before the fix, --batch 0 crashed with ZeroDivisionError, --n -5 with a tensor error after the header,
    # and --n 0, --head-dim 0, --repeats 0 (times "inf") and --threads 0 ran
    err = _fails(["bench", *args], capsys)
    assert message in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-buckets", "0"], "need num_buckets >= 4"),
        (["--num-buckets", "1", "--causal"], "causal T5 buckets need num_buckets >= 2"),
        (["--num-buckets", "7"], "odd num_buckets=7"),
        (["--max-distance", "8"], "max_distance must be larger than the exact region"),
        (["--max-distance", "-3"], "got max_distance=-3"),
        (["--num-buckets", "x"], "argument --num-buckets: invalid int value: 'x'"),
    ],
)
def test_buckets_errors(args, message, capsys):
    err = _fails(["buckets", *args], capsys)
    assert message in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--family", "t5", "--max-len", "0"], "--max-len must be >= 1 token, got 0"),
        (["--family", "t5", "--num-heads", "0"], "--num-heads must be >= 1, got 0"),
        (["--family", "t5", "--num-buckets", "7"], "odd num_buckets=7"),
        (["--family", "t5", "--num-buckets", "1", "--causal"], "causal T5 buckets need num_buckets >= 2"),
        (["--family", "t5", "--max-distance", "4"], "max_distance must be larger than the exact region"),
        (["--family", "offset", "--num-buckets", "8"], "--num-buckets applies to the t5 family only"),
        (["--family", "t5", "--pair", "100", "0"], "query must be a position in [0, 64), got 100"),
        (["--family", "rope"], "unknown bias family 'rope'"),
        (["--family", "t5", "--width", "0"], "--width must be in [16, 10000] pixels, got 0"),
        ([], "one of the arguments --family --state is required"),
    ],
)
def test_inspect_errors(args, message, capsys, tmp_path):
    err = _fails(["inspect", "--out-dir", str(tmp_path), *args], capsys)
    assert message in err
    assert list(tmp_path.iterdir()) == []  # no plot written


@pytest.mark.parametrize("suffix, message", [(".pt", "as a PyTorch state_dict: "), (".safetensors", "as safetensors: ")])
def test_inspect_on_a_file_that_is_not_a_state_dict_says_so_in_one_line(suffix, message, capsys, tmp_path):
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(b"not a tensor file at all" * 10)
    err = _fails(["inspect", "--state", str(path), "--no-plots"], capsys)
    assert err.startswith(f"relbias inspect: error: could not read {path} {message}")
    assert err.count("\n") == 1  # torch.load's multi-paragraph message is cut to its first line


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("It was the best of times, it was the worst of times. " * 40, "utf-8")
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lr", "nan"], "lr must be a positive finite number, got nan"),
        (["--lr", "-1"], "lr must be a positive finite number, got -1.0"),
        (["--lr", "0"], "lr must be a positive finite number, got 0.0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
        (["--val-fraction", "1.5"], "val_fraction must be in (0, 1), got 1.5"),
        (["--embed-dim", "6"], "embed_dim 6 must be divisible by num_heads 4"),
        (["--backend", "bogus"], "unknown backend 'bogus'"),
        (["--set", "t5.num_buckets=0", "--schemes", "t5"], "need num_buckets >= 2"),
        (["--set", "t5.max_distance=4", "--schemes", "t5"], "max_distance must be larger than the exact region"),
        (["--set", "nokey"], "expected FAMILY.KEY=VALUE"),
        (["--eval-lengths", "8,0"], "expected integers >= 1"),
        (["--schemes", "t5,t5"], "schemes must not repeat, got ['t5', 't5']"),
    ],
)
def test_extrapolate_errors_come_before_any_training_and_write_nothing(args, message, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    err = _fails(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--train-len", "8", "--steps", "2",
                  "--batch-size", "2", "--no-progress", *args], capsys)
    assert message in err
    assert not out.exists() or not any(out.iterdir())
