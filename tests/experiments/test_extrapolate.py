"""run_extrapolation: files after each model, seeds, resume per (scheme, seed), errors before training."""

from __future__ import annotations

import json

import pytest

from relbias.experiments import Corpus, ExtrapolationConfig, TrainConfig, run_extrapolation
from relbias.experiments.intervals import mean_interval

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom. " * 40).encode()
CORPUS = Corpus("tiny", TEXT)


def _config(**changes) -> ExtrapolationConfig:
    base = dict(
        train_len=8, eval_lengths=(8, 16, 32), embed_dim=16, num_heads=2, num_layers=1,
        train=TrainConfig(steps=6, batch_size=4, warmup=2), val_fraction=0.2,
    )
    base.update(changes)
    return ExtrapolationConfig(**base)


def test_results_are_written_per_model_and_resume_recomputes_only_missing_ones(tmp_path):
    seen = []
    full = run_extrapolation(_config(), ["none", "t5"], CORPUS, tmp_path, on_result=lambda s, e, r: seen.append(s))
    assert seen == ["none", "t5"]
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored == json.loads(json.dumps(full))
    assert set(stored["schemes"]) == {"none", "t5"} and stored["seeds"] == [0]
    assert sorted(stored["schemes"]["t5"]["runs"]["0"]["eval"]) == ["16", "32", "8"]
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| t5 |" in (tmp_path / "results.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp files left behind

    # An interrupted run: only "none" finished.
    del stored["schemes"]["t5"]["runs"]["0"]
    (tmp_path / "results.json").write_text(json.dumps(stored))
    events = []
    resumed = run_extrapolation(
        _config(), ["none", "t5"], CORPUS, tmp_path, resume=True,
        on_result=lambda s, e, r: events.append((s, e.get("resumed", False))),
    )
    assert events == [("none", True), ("t5", False)]
    # Seeded: the recomputed model gives the same numbers as the first run.
    assert resumed["schemes"]["t5"]["runs"]["0"]["eval"] == full["schemes"]["t5"]["runs"]["0"]["eval"]
    assert resumed["schemes"]["none"] == full["schemes"]["none"]


def test_seeds_change_the_numbers_and_one_seed_reproduces_them_bit_for_bit(tmp_path):
    schemes = ["alibi", "rotary", "sinusoidal"]
    first = run_extrapolation(_config(), schemes, CORPUS, tmp_path / "a", seeds=[0, 1])
    again = run_extrapolation(_config(), schemes, CORPUS, tmp_path / "b", seeds=[1])
    for scheme in schemes:
        runs = first["schemes"][scheme]["runs"]
        assert runs["0"]["eval"]["32"]["nll"] != runs["1"]["eval"]["32"]["nll"]  # initialisation and batches differ
        assert again["schemes"][scheme]["runs"]["1"]["eval"] == runs["1"]["eval"]  # exactly equal floats
        for n in ("8", "16", "32"):  # the summary is the mean and interval of the two runs
            expected = mean_interval([runs["0"]["eval"][n]["bpb"], runs["1"]["eval"][n]["bpb"]])
            assert first["schemes"][scheme]["summary"][n]["bpb"] == expected
            assert expected["half_width"] > 0
    table = (tmp_path / "a" / "results.md").read_text()
    assert "| rotary | full | 2 | " in table and "| rotary | window | 2 | " in table
    assert " ± " in table and "Student-t" in table


def test_resume_runs_only_the_missing_scheme_and_seed_pairs(tmp_path):
    full = run_extrapolation(_config(), ["none", "rotary"], CORPUS, tmp_path, seeds=[0, 1])
    stored = json.loads((tmp_path / "results.json").read_text())
    del stored["schemes"]["rotary"]["runs"]["1"]
    (tmp_path / "results.json").write_text(json.dumps(stored))
    events = []
    resumed = run_extrapolation(_config(), ["none", "rotary"], CORPUS, tmp_path, seeds=[0, 1], resume=True,
                                on_result=lambda s, e, r: events.append((s, e["seed"], e.get("resumed", False))))
    assert events == [("none", 0, True), ("rotary", 0, True), ("none", 1, True), ("rotary", 1, False)]
    assert resumed["schemes"]["rotary"]["runs"]["1"]["eval"] == full["schemes"]["rotary"]["runs"]["1"]["eval"]


def test_32l_is_refused_when_the_held_out_text_gives_too_few_windows(tmp_path):
    config = _config(eval_lengths=(8, 16, 32, 64, 128, 256), val_fraction=0.5)
    with pytest.raises(ValueError, match=r"evaluation length 256 \(32L\): the held-out text gives 6 window\(s\) of 256 "
                                         r"bytes \(1536 scored bytes\), at least 8 are needed"):
        run_extrapolation(config, ["none"], CORPUS, tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_resume_refuses_results_of_another_setup(tmp_path):
    run_extrapolation(_config(), ["none"], CORPUS, tmp_path)
    with pytest.raises(ValueError, match=r"cannot resume.*steps: 6 there, 7 now"):
        run_extrapolation(_config(train=TrainConfig(steps=7, batch_size=4, warmup=2)), ["none"], CORPUS, tmp_path,
                          resume=True)


def test_unreachable_evaluation_length_fails_before_any_training(tmp_path):
    config = _config(scheme_options={"offset": {"out_of_range": "error"}})
    with pytest.raises(ValueError, match=r"'offset' cannot be evaluated at length 16 \(trained at 8\).*'clip'"):
        run_extrapolation(config, ["none", "offset"], CORPUS, tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_training_length_longer_than_the_corpus(tmp_path):
    with pytest.raises(ValueError, match=r"training length 5000 is longer than the training split of corpus tiny"):
        run_extrapolation(_config(train_len=5000, eval_lengths=(5000,)), ["none"], CORPUS, tmp_path)


def test_unknown_scheme_lists_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown scheme\(s\) \['rope'\]; registered families: \[.*'t5'"):
        run_extrapolation(_config(), ["rope"], CORPUS, tmp_path)


def test_default_options_make_every_t5_bucket_trainable():
    config = _config(train_len=64, scheme_options={"t5": {"num_buckets": 16}})
    assert config.options_for("t5") == {"max_distance": 64, "num_buckets": 16}
    assert config.options_for("offset") == {"out_of_range": "clip"}


def test_windowed_scores_are_written_beside_full_attention_and_resumed(tmp_path):
    full = run_extrapolation(_config(), ["offset", "alibi"], CORPUS, tmp_path, seeds=[0, 1])
    assert full["config"]["eval_window"] == [7, 0]  # (L - 1, 0) for L = 8
    for scheme in ("offset", "alibi"):
        block = full["schemes"][scheme]
        for run in block["runs"].values():
            assert sorted(run["eval_windowed"]) == ["16", "32", "8", "whole_text"]
            assert run["eval_windowed"]["whole_text"]["tokens"] == run["eval_tokens"]
            assert run["windowed_seconds"] > 0
        runs = list(block["runs"].values())
        for n in ("8", "32", "whole_text"):
            values = [r["eval_windowed"][n]["bpb"] for r in runs]
            assert block["summary_windowed"][n]["bpb"] == mean_interval(values)
    table = (tmp_path / "results.md").read_text()
    assert "| scheme | attention | seeds | 8 (L) | 16 (2L) | 32 (4L) | whole text |" in table
    assert "| offset | full | 2 | " in table and "| offset | window | 2 | " in table and "window=(7, 0)" in table
    assert "| window eval s |" in table

    stored = json.loads((tmp_path / "results.json").read_text())
    del stored["schemes"]["alibi"]["runs"]["1"]
    (tmp_path / "results.json").write_text(json.dumps(stored))
    resumed = run_extrapolation(_config(), ["offset", "alibi"], CORPUS, tmp_path, seeds=[0, 1], resume=True)
    assert resumed["schemes"]["offset"] == full["schemes"]["offset"]  # kept, windowed scores included
    again, before = resumed["schemes"]["alibi"]["runs"]["1"], full["schemes"]["alibi"]["runs"]["1"]
    assert again["eval_windowed"] == before["eval_windowed"]  # recomputed: the same numbers


def test_without_the_windowed_evaluation_the_results_are_as_before_and_do_not_resume_a_windowed_run(tmp_path):
    plain = run_extrapolation(_config(windowed_eval=False), ["none"], CORPUS, tmp_path)
    assert "eval_window" not in plain["config"] and "windowed_eval" not in plain["config"]
    run = plain["schemes"]["none"]["runs"]["0"]
    assert "eval_windowed" not in run and "summary_windowed" not in plain["schemes"]["none"]
    assert "| attention |" not in (tmp_path / "results.md").read_text()
    with pytest.raises(ValueError, match=r"eval_window: None there, \[7, 0\] now.*without the windowed evaluation"):
        run_extrapolation(_config(), ["none"], CORPUS, tmp_path, resume=True)
    with pytest.raises(ValueError, match="windowed_eval must be a bool"):
        run_extrapolation(_config(windowed_eval="yes"), ["none"], CORPUS, tmp_path / "other")
