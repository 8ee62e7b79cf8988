"""``relbias explain``: relbias.explain_backend's answer for calls of ``relbias bench``'s shapes, from the shell."""

from __future__ import annotations

import torch

import relbias
from relbias.biases import make_bias
from relbias.cli.main import main


def _answers(out: str) -> list[tuple[str, str]]:
    """(header, reason) per call printed: a "# ..." line, then the reason's lines."""
    blocks = [block for block in out.strip().split("\n\n")]
    return [(block.split("\n", 1)[0], block.split("\n", 1)[1]) for block in blocks]


def test_each_call_is_explained_as_explain_backend_explains_it(capsys):
    assert main(["explain", "--n", "64", "--causal", "both", "--mode", "both", "--heads", "2", "--head-dim", "8",
                 "--family", "alibi"]) == 0
    answers = _answers(capsys.readouterr().out)
    assert [header for header, _ in answers] == [
        f"# B=1 H=2 Lq=64 Lk=64 D=8 float32, bias alibi, {masking}, {mode}"
        for masking in ("causal", "bidirectional") for mode in ("forward (inference)", "forward+backward")]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    for (_, reason), (causal, grad) in zip(answers, [(True, False), (True, True), (False, False), (False, True)]):
        bias = make_bias("alibi", num_heads=2, max_len=64, bidirectional=not causal).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            inputs = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            _, want = relbias.explain_backend(*inputs, bias=bias, is_causal=causal, convention="t5")
        assert reason == want
        assert reason.split("\n")[0].split(": ")[1].startswith("causal" if causal else "bidirectional")
        assert ("forward and backward" if grad else "forward only (inference)") in reason.split("\n")[0]


def test_a_decoding_step_names_decode_or_says_why_not(capsys):
    assert main(["explain", "--n", "300", "--queries", "1", "--dtype", "bfloat16"]) == 0
    header, reason = _answers(capsys.readouterr().out)[0]
    assert header == "# B=1 H=8 Lq=1 Lk=300 D=64 bfloat16, bias t5, causal, forward (inference)"
    # the note on how bfloat16 runs here is said once, whichever backend runs
    assert reason.count("note: bfloat16 runs") == 1 and reason.count("oneDNN finds no") <= 1, reason
    assert reason.split(":")[0] in ("decode", "toeplitz")


def test_a_named_backend_that_cannot_run_exits_2_with_its_reason(capsys):
    assert main(["explain", "--n", "64", "--backend", "decode"]) == 2
    assert "backend 'decode' cannot run this call: 64 queries" in capsys.readouterr().err
    assert main(["explain", "--n", "64", "--queries", "65"]) == 2
    assert "--queries 65 is more than the 64 keys" in capsys.readouterr().err
