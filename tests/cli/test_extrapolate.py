"""``relbias extrapolate`` end to end on tiny corpora, its errors, and --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relbias.biases import FAMILIES
from relbias.cli.main import main

TINY = ["--train-len", "8", "--steps", "3", "--batch-size", "4", "--embed-dim", "16", "--num-heads", "2",
        "--num-layers", "1", "--no-progress", "--threads", "1"]
SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 80, "utf-8")
    return path


def test_every_registered_family_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert list(results["schemes"]) == list(FAMILIES)  # default: every registered family, in order
    assert results["config"]["eval_lengths"] == [8, 16, 32, 64]
    for block in results["schemes"].values():
        for scores in block["runs"]["0"]["eval"].values():
            assert 0.0 < scores["bpb"] < 9.0  # a barely trained byte model sits near log2(256) = 8
    assert "64 (8L)" in printed and "Perplexity per byte" in printed
    for scheme in FAMILIES:
        assert f"\n{scheme} " in printed
    import matplotlib.image

    assert matplotlib.image.imread(out / "results.png").shape[:2] == (420, 1200)  # full and windowed panels
    assert "## Bits per byte" in (out / "results.md").read_text()
    assert results["config"]["eval_window"] == [7, 0] and "window=(7, 0)" in printed
    for scheme in FAMILIES:  # full attention and the window side by side, in the table and in each model's line
        assert f"\n{scheme} " in printed and "| window " in printed
        assert results["schemes"][scheme]["summary_windowed"]["whole_text"]["bpb"]["mean"] > 0


def test_no_windowed_eval_runs_full_attention_only(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "offset",
                 "--no-windowed-eval", *TINY]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert "eval_window" not in results["config"] and "eval_windowed" not in results["schemes"]["offset"]["runs"]["0"]
    assert "window=(" not in printed and " window " not in printed and "whole text" not in printed
    import matplotlib.image

    assert matplotlib.image.imread(out / "results.png").shape[:2] == (420, 760)


def test_the_windowed_evaluation_flag_is_documented():
    import argparse

    from relbias.cli.extrapolate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    help_text = " ".join(parser._subparsers._group_actions[0].choices["extrapolate"].format_help().split())
    assert "--windowed-eval, --no-windowed-eval" in help_text and "window=(L-1, 0)" in help_text


def test_seeds_and_baselines_end_to_end_with_intervals(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "alibi,sinusoidal,rotary",
                 "--num-seeds", "2", "--eval-mode", "sliding", "--stride", "4", *TINY]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["seeds"] == [0, 1] and results["config"]["eval_mode"] == "sliding"
    assert results["config"]["stride"] == 4
    for scheme in ("alibi", "sinusoidal", "rotary"):
        assert sorted(results["schemes"][scheme]["runs"]) == ["0", "1"]
        half = results["schemes"][scheme]["summary"]["64"]["bpb"]["half_width"]
        assert f"{results['schemes'][scheme]['summary']['64']['bpb']['mean']:.3f} ± {half:.3f}" in printed
    assert "95% Student-t interval" in printed and "seeds 0,1;" in printed and "sliding, stride 4" in printed


def test_resume_keeps_finished_schemes(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "none", *TINY]) == 0
    first = json.loads((out / "results.json").read_text())["schemes"]["none"]["runs"]
    capsys.readouterr()
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "none,t5", "--resume",
                 *TINY]) == 0
    printed = capsys.readouterr()
    assert "from results.json" in printed.out + printed.err
    results = json.loads((out / "results.json").read_text())
    assert results["schemes"]["none"]["runs"] == first and "0" in results["schemes"]["t5"]["runs"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--corpus", "MISSING"], "corpus MISSING does not exist"),
        (["--corpus", "EMPTY"], "is empty"),
        (["--train-len", "100000", "--eval-lengths", "100000"], "training length 100000 is longer than the training split"),
        (["--offset-out-of-range", "error", "--schemes", "offset"],
         "'offset' cannot be evaluated at length 16 (trained at 8): offset 15 has no parameter"),
        (["--eval-lengths", "4000"], "held-out split has"),
        (["--schemes", "rope"], "unknown scheme(s) ['rope']; registered families: ["),
        (["--schemes", "rope"], "baselines: ['rotary', 'sinusoidal']"),
        (["--set", "rotary.base=500", "--schemes", "rotary"], "the 'rotary' baseline takes no options"),
        (["--seeds", "0,1,0"], "--seeds must not repeat, got 0,1,0"),
        (["--num-seeds", "0"], "--num-seeds must be >= 1, got 0"),
        (["--stride", "4"], "--stride 4 applies to --eval-mode sliding, not nonoverlapping"),
        (["--eval-mode", "sliding", "--stride", "9"], "sliding stride must be an int in [1, 8]"),
        (["--eval-lengths", "8,16,32,64,128,256"], "evaluation length 128 (16L): the held-out text gives 4 window(s)"),
        (["--schemes", "t5,xyz"], "unknown scheme(s) ['xyz']"),
        (["--schemes", "t5,xyz", "--set", "xyz.a=1"], "unknown scheme(s) ['xyz']"),
        (["--schemes", "t5,alibi,t5"], "schemes must not repeat"),
        (["--set", "t5.num_buckets=1", "--schemes", "t5"], "'num_buckets': 1}: causal T5 buckets need num_buckets >= 2"),
        (["--set", "alibi.colour=1", "--schemes", "alibi"], "scheme 'alibi' with options {'colour': 1}"),
        (["--set", "t5.max_dist=3", "--schemes", "t5"], "bias family 't5' does not take option 'max_dist'"),
        (["--set", "rope.x=1", "--schemes", "alibi"], "--set rope.x=1: 'rope' is not a registered family"),
        (["--set", "t5.max_distance=32", "--schemes", "alibi"], "'t5' is a registered family but not among the schemes run (alibi)"),
    ],
)
def test_errors_are_one_clear_line(extra, message, corpus, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("", "utf-8")
    args = ["extrapolate", "--corpus", str(corpus), "--out", str(tmp_path / "out"), *TINY]
    args += [str(tmp_path / "missing.txt") if e == "MISSING" else str(tmp_path / "empty.txt") if e == "EMPTY" else e
             for e in extra]
    message = message.replace("MISSING", str(tmp_path / "missing.txt"))
    assert main(args) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith("relbias extrapolate: error: ") and message in printed.err
    assert printed.out == ""  # every setting is checked before the header is printed
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("extra, message", [
    (["--seeds", "0,-1"], "argument --seeds: expected integers >= 0 (e.g. 0,1,2), got '0,-1'"),
    (["--seed", "1", "--seeds", "0,1"], "argument --seeds: not allowed with argument --seed"),
    (["--eval-mode", "strided"], "argument --eval-mode: invalid choice: 'strided'"),
])
def test_argument_errors_name_the_argument(extra, message, corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["extrapolate", "--corpus", str(corpus), "--out", str(tmp_path / "out"), *TINY, *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_resume_with_another_config_prints_only_its_error(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "none", *TINY]) == 0
    capsys.readouterr()
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "none", "--resume",
                 "--lr", "0.01", *TINY]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.startswith("relbias extrapolate: error: ")


def test_a_fully_resumed_run_still_prints_its_header_first(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "none", *TINY]) == 0
    capsys.readouterr()
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(out), "--schemes", "none", "--resume",
                 *TINY]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("relbias extrapolate: corpus ") and "from results.json" in lines[1]


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="../shared/data/tinyshakespeare.txt is not present")
def test_runs_on_tiny_shakespeare(tmp_path):
    out = tmp_path / "out"
    assert main(["extrapolate", "--corpus", str(SHAKESPEARE), "--out", str(out), "--schemes", "alibi,t5",
                 "--max-eval-bytes", "2048", *TINY]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["corpus_bytes"] == SHAKESPEARE.stat().st_size
    assert results["schemes"]["t5"]["runs"]["0"]["eval_tokens"] == 1984  # 31 x lcm(8, 16, 32, 64): 2048 bytes hold 1984 + 1


def test_quick_runs_write_beside_the_full_results_not_over_them(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["extrapolate", "--quick", "--corpus", str(corpus), "--schemes", "none", *TINY]) == 0
    assert (tmp_path / "runs" / "extrapolate-quick" / "results.json").exists()
    assert not (tmp_path / "runs" / "extrapolate").exists()


def _starts_a_line(text: str, line: str) -> bool:
    """Whether ``line`` is in ``text`` at the start of a terminal line (after a newline or a carriage return that
    follows a cleared bar), not glued to a progress bar's text."""
    at = text.find(line)
    return at == 0 or (at > 0 and text[at - 1] in "\r\n")


def test_log_lines_during_a_progress_bar_are_written_above_it(capsys):
    import logging

    from relbias.cli.extrapolate import _progress_hook

    hook, _, log_through_bars = _progress_hook(False)
    with log_through_bars:
        for step in hook(range(3), desc="train", total=3):
            if step == 1:
                logging.getLogger("relbias.backends.toeplitz._build").warning("relbias: a build notice")
    err = capsys.readouterr().err
    assert "train" in err and _starts_a_line(err, "relbias: a build notice\n")


def test_the_kernels_are_loaded_before_the_first_progress_bar(corpus, tmp_path, capsys, monkeypatch):
    """A first build (about 50 s) must not be timed as the first training step's or the first scheme's: it runs, and
    says so, before any bar is drawn and before the experiment (and its timers) starts."""
    import logging

    import relbias.experiments
    from relbias.backends.toeplitz import _native

    loaded, original, events = [], _native.load_native, []

    def load_native():
        if not loaded:  # the notice a first build logs
            logging.getLogger("relbias.backends.toeplitz._build").warning("relbias: compiling (test)")
            events.append("build")
        loaded.append(True)
        return original()

    run_extrapolation = relbias.experiments.run_extrapolation
    monkeypatch.setattr(relbias.experiments, "run_extrapolation",
                        lambda *a, **k: events.append("experiment") or run_extrapolation(*a, **k))
    monkeypatch.setattr(_native, "load_native", load_native)
    args = [a for a in TINY if a != "--no-progress"]
    assert main(["extrapolate", "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--schemes", "t5", *args]) == 0
    err = capsys.readouterr().err
    assert loaded and _starts_a_line(err, "relbias: compiling (test)\n")
    assert err.index("relbias: compiling (test)") < err.index("it/s]")  # before the first bar
    assert events == ["build", "experiment"]  # and before the experiment times its first scheme
