"""One constructor rule for every family (docs/conventions.md, "Constructors and direction"): num_heads is the
only positional argument, PerOffsetBias takes keywords only, every family defaults to bidirectional=True, and a
bidirectional T5 / per-offset table used with is_causal=True warns once per module (issue 14, item 3)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import relbias
from relbias import ALiBiBias, FIREBias, KerpleLogBias, KerplePowerBias, PerOffsetBias, T5Bias

HEADED = [T5Bias, ALiBiBias, KerpleLogBias, KerplePowerBias, FIREBias]


@pytest.mark.parametrize("family", HEADED + [PerOffsetBias], ids=lambda f: f.__name__)
def test_every_family_defaults_to_bidirectional_and_takes_later_arguments_by_keyword(family):
    params = list(inspect.signature(family).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == ([] if family is PerOffsetBias else ["num_heads"])
    bias = family(max_len=8) if family is PerOffsetBias else family(4)
    assert bias.bidirectional is True


@pytest.mark.parametrize("family", HEADED, ids=lambda f: f.__name__)
def test_the_positional_number_is_the_number_of_heads(family):
    assert family(4).num_heads == 4


def test_per_offset_refuses_a_positional_number_instead_of_guessing():
    with pytest.raises(TypeError, match=r"keyword arguments only, got positional \(8,\).*max_len=8"):
        PerOffsetBias(8)
    with pytest.raises(TypeError, match="needs max_len="):
        PerOffsetBias(num_heads=2)
    assert PerOffsetBias(max_len=8, num_heads=2).weight.shape == (15, 2)


@pytest.mark.parametrize("family", [ALiBiBias, KerpleLogBias, KerplePowerBias, FIREBias], ids=lambda f: f.__name__)
def test_the_bidirectional_default_equals_the_causal_form_on_past_keys(family):
    both, causal = family(2), family(2, bidirectional=False)
    causal.load_state_dict(both.state_dict())
    q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch warning for these families
        torch.testing.assert_close(relbias.attention(q, k, v, bias=both, is_causal=True),
                                   relbias.attention(q, k, v, bias=causal, is_causal=True))


@pytest.mark.parametrize("bias", [T5Bias(2), PerOffsetBias(max_len=8, num_heads=2)], ids=["t5", "offset"])
def test_a_bidirectional_table_under_is_causal_warns_once_per_module(bias):
    q = torch.randn(1, 2, 5, 4)
    with pytest.warns(UserWarning, match=r"bidirectional=True\) used with is_causal=True.*pass bidirectional=False"):
        relbias.attention(q, q, q, bias=bias, is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relbias.attention(q, q, q, bias=bias, is_causal=True)  # once per module
        relbias.attention(q, q, q, bias=type(bias)(2) if isinstance(bias, T5Bias) else bias, is_causal=False)
    causal = T5Bias(2, bidirectional=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relbias.attention(q, q, q, bias=causal, is_causal=True)
