"""``relbias inspect`` end to end: JSON report, PNG plots of the requested size, T5 tables from files, errors."""

import json
import struct
import subprocess
import sys

import pytest
import torch

import relbias
from relbias.biases import FAMILIES
from relbias.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_json(capsys, *argv):
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_t5_family_report_and_plots(tmp_path, capsys):
    info = run_json(
        capsys, "--family", "t5", "--num-heads", "4", "--max-len", "40", "--out-dir", str(tmp_path),
        "--width", "320", "--height", "240", "--pair", "30", "10",
    )
    ranges = relbias.t5_bucket_ranges(bidirectional=True, num_buckets=32, max_distance=128)
    assert [(e["bucket"], e["lowest_offset"], e["highest_offset"]) for e in info["bucket_map"]] == ranges
    assert info["parameter_count"] == 32 * 4 and info["default_convention"] == "t5"
    # offset 20 is in bucket 10 (design.md §4), which holds offsets 16..22: every pair at those offsets.
    assert ranges[10] == (10, 16, 22)
    expected = [[q, k] for q in range(40) for k in range(40) if 16 <= q - k <= 22]
    assert info["pairs_sharing"]["pairs"] == expected and info["pairs_sharing"]["count"] == len(expected)
    # the curve runs past max_distance's last bucket (91+ here), not only to L - 1 = 39: every bucket shows
    offsets = info["bias_vs_offset"]["offsets"]
    assert info["bias_vs_offset"]["saturation_offset"] == 91 and offsets[0] < -91 and offsets[-1] > 91
    assert offsets == list(range(offsets[0], -offsets[0] + 1)) and len(info["bias_vs_offset"]["values"]) == 4
    reached = set(relbias.t5_bucket(torch.tensor(offsets), bidirectional=True, num_buckets=32, max_distance=128).tolist())
    assert reached == {b for b, lo, hi in ranges if (lo, hi) != (None, None)}
    assert info["values"] == "random initialisation (seed 0), not learned values"
    for path in info["plots"].values():
        assert png_size(tmp_path / path.split("/")[-1]) == (320, 240)
    import matplotlib.image

    assert matplotlib.image.imread(info["plots"]["heatmap"]).shape[:2] == (240, 320)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_writes_both_plots(family, tmp_path, capsys):
    info = run_json(
        capsys, "--family", family, "--num-heads", "3", "--max-len", "12", "--causal", "--out-dir", str(tmp_path),
        "--width", "200", "--height", "160",
    )
    assert sorted(info["plots"]) == ["bias_vs_offset", "heatmap"]
    for path in info["plots"].values():
        assert png_size(tmp_path / path.split("/")[-1]) == (200, 160)
    bias = relbias.biases.make_bias(family, num_heads=3, max_len=12, bidirectional=False)
    assert info["parameter_count"] == (0 if bias is None else sum(p.numel() for p in bias.parameters()))
    offsets = info["bias_vs_offset"]["offsets"]  # causal: offsets 0 .. L-1, or past T5's last bucket
    assert offsets == list(range(12 if family != "t5" else info["bias_vs_offset"]["saturation_offset"] + 23))


def test_alibi_curves_are_minus_slope_times_distance(capsys):
    info = run_json(capsys, "--family", "alibi", "--num-heads", "6", "--max-len", "5", "--bidirectional", "--no-plots")
    assert info["constants"]["slopes"] == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    offsets = info["bias_vs_offset"]["offsets"]
    assert offsets == list(range(-4, 5))
    for slope, row in zip(info["constants"]["slopes"], info["bias_vs_offset"]["values"]):
        assert row == pytest.approx([-slope * abs(d) for d in offsets])
    assert info["plots"] == {}


def test_fire_curve_is_taken_at_the_last_query(capsys):
    info = run_json(capsys, "--family", "fire", "--num-heads", "2", "--max-len", "6", "--causal", "--no-plots")
    torch.manual_seed(0)
    bias = relbias.FIREBias(2)
    with torch.no_grad():
        expected = bias(6, 6)[:, -1].flip(-1)  # query 5, keys 5 .. 0 = offsets 0 .. 5
    assert info["offset_only"] is False and info["bias_vs_offset"]["query_position"] == 5
    assert torch.allclose(torch.tensor(info["bias_vs_offset"]["values"]), expected, atol=1e-6)


def _hf_state(num_buckets=32, heads=4):
    torch.manual_seed(1)
    return {
        "shared.weight": torch.randn(10, 8),
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": torch.randn(num_buckets, heads),
        "encoder.block.0.layer.0.SelfAttention.q.weight": torch.randn(8, 8),
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": torch.randn(num_buckets, heads),
        "decoder.block.0.layer.0.SelfAttention.q.weight": torch.randn(8, 8),
    }


def test_safetensors_decoder_table_is_read_as_causal(tmp_path, capsys):
    from safetensors.torch import save_file

    state = _hf_state()
    save_file(state, str(tmp_path / "model.safetensors"))
    info = run_json(
        capsys, "--state", str(tmp_path / "model.safetensors"), "--stack", "decoder", "--max-len", "20",
        "--out-dir", str(tmp_path), "--width", "240", "--height", "200",
    )
    table = state["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert info["bidirectional"] is False and info["parameter_count"] == table.numel()
    assert info["source"]["key"].startswith("decoder.block.0")
    offsets = torch.tensor(info["bias_vs_offset"]["offsets"])
    buckets = relbias.t5_bucket(offsets, bidirectional=False)
    assert torch.allclose(torch.tensor(info["bias_vs_offset"]["values"]), table[buckets].T)
    assert info["bucket_map"][17] == {"bucket": 17, "lowest_offset": 19, "highest_offset": 20}
    assert png_size(tmp_path / "t5_table_heatmap.png") == (240, 200)


def test_prefixed_half_precision_table_is_named_as_stored_and_read_as_float32(tmp_path, capsys):
    from safetensors.torch import save_file

    from relbias.integrations.loading import t5_bias_from_file

    state = {f"model.{k}": v.half() for k, v in _hf_state().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    info = run_json(capsys, "--state", str(tmp_path / "model.safetensors"), "--no-plots")
    assert info["source"]["key"] == "model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    before = torch.random.get_rng_state()
    bias, where = t5_bias_from_file(tmp_path / "model.safetensors", stack="decoder")
    assert torch.equal(torch.random.get_rng_state(), before)  # building the module draws no random numbers
    assert where.startswith("model.decoder.block.0") and bias.weight.dtype == torch.float32
    assert torch.equal(bias.weight, state[where].float()) and not bias.bidirectional


def test_pt_file_with_a_bare_table_and_text_output(tmp_path, capsys):
    table = torch.randn(8, 2)
    torch.save(table, tmp_path / "table.pt")
    argv = ["inspect", "--state", str(tmp_path / "table.pt"), "--max-distance", "16", "--max-len", "10", "--no-plots"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "T5Bias, 2 heads, bidirectional" in out and "learnable parameters: 16" in out
    for bucket, lo, hi in relbias.t5_bucket_ranges(num_buckets=8, max_distance=16):
        assert any(line.split()[:1] == [str(bucket)] for line in out.splitlines())
    assert "(unused: distance 0 towards the future is offset 0, bucket 0)" in out  # bidirectional bucket num_buckets // 2


def test_named_key_from_a_state_dict(tmp_path, capsys):
    torch.save({"weight": torch.randn(32, 3), "other": torch.randn(5, 5)}, tmp_path / "bias.pt")
    info = run_json(capsys, "--state", str(tmp_path / "bias.pt"), "--key", "weight", "--causal", "--no-plots")
    assert info["num_heads"] == 3 and info["bidirectional"] is False and info["source"]["key"] == "weight"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--family", "rope"], "unknown bias family 'rope'"),
        (["--family", "alibi", "--num-buckets", "16"], "--num-buckets applies to the t5 family only"),
        (["--family", "t5", "--key", "x"], "--key reads a --state file"),
        (["--family", "t5", "--width", "0"], "--width must be in"),
        (["--family", "t5", "--max-len", "0"], "--max-len must be >= 1 token"),
        (["--family", "t5", "--num-buckets", "7"], "odd num_buckets=7"),
        (["--family", "alibi", "--causal", "--pair", "2", "5"], "key 5 is after query 2"),
        (["--state", "/nonexistent/model.safetensors"], "no file at"),
    ],
)
def test_bad_settings_exit_2_with_a_clear_message(argv, message, capsys, tmp_path):
    assert main(["inspect", *argv, "--no-plots", "--out-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_bad_state_files_exit_2_with_a_clear_message(tmp_path, capsys):
    torch.save({"a": torch.randn(4, 2), "b": torch.randn(4, 2)}, tmp_path / "two.pt")
    torch.save({"weight": torch.randn(32)}, tmp_path / "flat.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    from safetensors.torch import save_file

    save_file(_hf_state(), str(tmp_path / "model.safetensors"))
    cases = [
        ([str(tmp_path / "two.pt")], "found 2 2-D float tensors"),
        ([str(tmp_path / "flat.pt"), "--key", "weight"], "a T5 table is 2-D float"),
        ([str(tmp_path / "two.pt"), "--key", "c"], "has no tensor 'c'"),
        ([str(tmp_path / "junk.pt")], "could not read"),
        ([str(tmp_path / "junk.safetensors")], "could not read"),
        ([str(tmp_path / "model.safetensors"), "--causal"], "the encoder table of a T5 model is bidirectional"),
        ([str(tmp_path / "model.safetensors"), "--num-heads", "8"], "--num-heads 8 does not match"),
    ]
    for argv, message in cases:
        assert main(["inspect", "--state", *argv, "--no-plots"]) == 2
        assert message in capsys.readouterr().err, argv


def test_missing_matplotlib_gives_a_clear_message_and_no_plots_still_works(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["inspect", "--family", "alibi", "--out-dir", str(tmp_path)]) == 2
    assert "pip install 'relbias[cli]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["inspect", "--family", "alibi", "--no-plots"]) == 0


def test_console_entry_point_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "relbias.cli.main", "inspect", "--family", "kerple_log", "--num-heads", "2",
         "--max-len", "8", "--out-dir", str(tmp_path), "--width", "300", "--height", "200"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "KerpleLogBias, 2 heads" in result.stdout and "r1:" in result.stdout
    assert png_size(tmp_path / "kerple_log_bias_vs_offset.png") == (300, 200)
    assert png_size(tmp_path / "kerple_log_heatmap.png") == (300, 200)


def _captured_figures(monkeypatch):
    """Figures ``inspect`` saves, by file name, so that a test can read their axes and titles."""
    from matplotlib.figure import Figure

    figures = {}
    save = Figure.savefig

    def savefig(fig, path, *a, **kw):
        figures[str(path).split("/")[-1]] = fig
        return save(fig, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def test_plots_say_a_fresh_table_is_a_random_initialisation(tmp_path, capsys, monkeypatch):
    figures = _captured_figures(monkeypatch)
    assert main(["inspect", "--family", "t5", "--num-heads", "2", "--max-len", "16", "--out-dir", str(tmp_path)]) == 0
    assert "values: random initialisation (seed 0), not learned values" in capsys.readouterr().out
    assert len(figures) == 2
    for fig in figures.values():
        assert "random initialisation (seed 0), not learned values" in fig.get_suptitle()
    figures.clear()
    info = run_json(capsys, "--family", "alibi", "--num-heads", "2", "--out-dir", str(tmp_path))
    assert info["values"] == "fixed (no learnable parameters)"
    assert all("random" not in fig.get_suptitle() for fig in figures.values())
    torch.save(torch.randn(8, 2), tmp_path / "table.pt")
    info = run_json(capsys, "--state", str(tmp_path / "table.pt"), "--max-distance", "16", "--no-plots")
    assert info["values"] == "learned (read from the file)"


def test_alibi_legend_gives_each_head_its_slope(tmp_path, capsys, monkeypatch):
    figures = _captured_figures(monkeypatch)
    run_json(capsys, "--family", "alibi", "--num-heads", "4", "--causal", "--out-dir", str(tmp_path))
    (ax,) = figures["alibi_bias_vs_offset.png"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "head 0, slope 1/4", "head 1, slope 1/16", "head 2, slope 1/64", "head 3, slope 1/256"]


def test_eight_heads_get_one_panel_each_or_a_chosen_head(tmp_path, capsys, monkeypatch):
    figures = _captured_figures(monkeypatch)
    run_json(capsys, "--family", "alibi", "--num-heads", "8", "--out-dir", str(tmp_path))
    panels = [ax for ax in figures["alibi_bias_vs_offset.png"].axes if ax.axison]
    assert [ax.get_title() for ax in panels] == [f"head {h}, slope 1/{2 ** (h + 1)}" for h in range(8)]
    assert all(len(ax.get_lines()) == 1 + 2 for ax in panels)  # its curve, and the +-(L - 1) marks
    figures.clear()
    info = run_json(capsys, "--family", "alibi", "--num-heads", "8", "--head", "2", "--out-dir", str(tmp_path))
    (ax,) = figures["alibi_bias_vs_offset.png"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["head 2, slope 1/8"]
    assert [a.get_title() for a in figures["alibi_heatmap.png"].axes if a.get_images()] == ["head 2, slope 1/8"]
    assert len(info["bias_vs_offset"]["values"]) == 8  # the report keeps every head
    assert main(["inspect", "--family", "alibi", "--num-heads", "8", "--head", "8", "--no-plots"]) == 2
    assert "--head 8 is not a head of this bias, which has 8 (0 .. 7)" in capsys.readouterr().err


def test_a_pickle_refused_by_weights_only_is_one_actionable_line(tmp_path, capsys):
    import fractions

    torch.save({"weight": torch.randn(32, 2), "note": fractions.Fraction(1, 3)}, tmp_path / "pickled.pt")
    assert main(["inspect", "--state", str(tmp_path / "pickled.pt"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err  # one line, no terminal escapes
    assert "holds a pickled fractions.Fraction" in err and "re-save only its tensors" in err
