"""run_extrapolation: files after each model, resume after a partial results file, errors before training."""

from __future__ import annotations

import json

import pytest

from relbias.experiments import Corpus, ExtrapolationConfig, TrainConfig, run_extrapolation

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
    assert set(stored["schemes"]) == {"none", "t5"}
    assert sorted(stored["schemes"]["t5"]["eval"]) == ["16", "32", "8"]
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| t5 |" in (tmp_path / "results.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp files left behind

    # An interrupted run: only "none" finished.
    del stored["schemes"]["t5"]
    (tmp_path / "results.json").write_text(json.dumps(stored))
    events = []
    resumed = run_extrapolation(
        _config(), ["none", "t5"], CORPUS, tmp_path, resume=True,
        on_result=lambda s, e, r: events.append((s, e.get("resumed", False))),
    )
    assert events == [("none", True), ("t5", False)]
    # Seeded: the recomputed model gives the same numbers as the first run.
    assert resumed["schemes"]["t5"]["eval"] == full["schemes"]["t5"]["eval"]
    assert resumed["schemes"]["none"] == full["schemes"]["none"]


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
