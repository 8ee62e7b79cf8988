"""The backends as the docs describe them are the backends as the code describes itself: ``relbias.attention``'s
docstring (and so the API reference) gives each built-in backend's ``summary`` word for word, the backends page has a
row for each, and a refusal of dropout names the backends that apply it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import relbias
from relbias.backends import BACKENDS
from relbias.backends.toeplitz import _native

BUILT_IN = ["decode", "triton", "flex", "toeplitz", "structured", "blockwise", "reference"]


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_attention_docstring_gives_each_backends_summary(name):
    assert f'* "{name}": {_words(BACKENDS[name].summary)}' in _words(relbias.attention.__doc__)


def test_the_backends_page_has_a_row_for_each_backend():
    page = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text()
    assert all(f"| `{name}` |" in page for name in BUILT_IN)
    assert list(BACKENDS)[: len(BUILT_IN)] == BUILT_IN  # the priority order the docstring lists


def test_dropout_refusals_name_the_backends_that_apply_it_and_they_do():
    q = torch.randn(1, 2, 64, 8)
    bias = relbias.T5Bias(2, bidirectional=False)
    with pytest.raises(ValueError, match=r"reference, blockwise, toeplitz \(where its native kernels run\) and triton") as refused:
        relbias.attention(q, q, q, bias=bias, is_causal=True, dropout_p=0.1, backend="structured")
    assert "dropout" in str(refused.value)
    applying = ["reference", "blockwise"] + (["toeplitz"] if _native.load_native() is not None else [])
    for name in applying:
        relbias.explain_backend(q, q, q, bias=bias, is_causal=True, dropout_p=0.1, backend=name)  # runs: no error


def test_explain_describes_an_inference_call_as_it_is():
    # a plain T5 call: grad mode on, only the bias table requires grad; under no_grad no gradient is mentioned
    q = torch.randn(1, 8, 128, 64)
    bias = relbias.T5Bias(8)
    name, reason = relbias.explain_backend(q, q, q, bias=bias)
    assert "requires_grad is set on: T5Bias's parameters" in reason and "torch.no_grad()" in reason
    with torch.no_grad():
        name_no_grad, reason_no_grad = relbias.explain_backend(q, q, q, bias=bias)
    assert "gradient" not in reason_no_grad
    # the small-block reason by which auto passes over a tiled backend does not say materialising is the choice
    for chosen, why in ((name, reason), (name_no_grad, reason_no_grad)):
        if chosen != "reference":
            assert "small block" not in why or "single fused kernel call or materialising" in why
    # the first line says what this call does, not everything the backend can take
    first, first_no_grad = reason.split("\n")[0], reason_no_grad.split("\n")[0]
    assert first.startswith(f"{name}: bidirectional, offset-only T5Bias, no mask, no dropout, forward and backward, "
                            "float32: ")
    assert first_no_grad.startswith(f"{name_no_grad}: bidirectional, offset-only T5Bias, no mask, no dropout, "
                                    "forward only (inference), float32: ")
    if name_no_grad == "toeplitz":
        assert "backward" not in first_no_grad and "dropout inside" not in first_no_grad, first_no_grad
        assert first.endswith("FlashAttention-2 forward and backward; memory O(N·D)") == (
            _native.native_unavailable_reason() is None), first
        with torch.no_grad():
            dropped = relbias.explain_backend(q, q, q, bias=bias, dropout_p=0.1)[1].split("\n")[0]
        assert "dropout_p=0.1" in dropped and ("dropout inside the kernels" in dropped) == (
            _native.native_unavailable_reason() is None), dropped
