"""A bias module whose parameters hold NaN/inf is refused like a non-finite bias tensor (issue 14, item 2):
an error naming the family, the parameter and the entry, on every backend and through explain_backend."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends import BACKENDS
from relbias.biases import FAMILIES, make_bias


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_a_non_finite_table_entry_is_refused_naming_family_parameter_and_entry(backend, value):
    bias = relbias.T5Bias(2)
    with torch.no_grad():
        bias.weight[3, 1] = value
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=rf"T5Bias parameter 'weight' holds {value} at entry \[3, 1\]"):
        relbias.attention(q, q, q, bias=bias, backend=backend)


@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "none"])
def test_every_family_with_parameters_is_checked(family):
    bias = make_bias(family, num_heads=2, max_len=8, bidirectional=True)
    params = list(bias.named_parameters())
    if not params:
        pytest.skip(f"{family} has no parameters")
    name, param = params[-1]
    with torch.no_grad():
        param.view(-1)[-1] = float("nan")
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=rf"parameter '{name}' holds nan"):
        relbias.explain_backend(q, q, q, bias=bias)


def test_finite_parameters_pass_and_meta_parameters_are_not_read():
    q = torch.randn(1, 2, 5, 4)
    assert relbias.attention(q, q, q, bias=relbias.T5Bias(2)).shape == (1, 2, 5, 4)
    meta = relbias.T5Bias(2).to("meta")
    qm = q.to("meta")
    assert relbias.attention(qm, qm, qm, bias=meta, backend="reference").shape == (1, 2, 5, 4)


def test_a_parameter_changed_after_a_checked_call_is_checked_again():
    bias = relbias.T5Bias(2)
    q = torch.randn(1, 2, 5, 4)
    relbias.attention(q, q, q, bias=bias)  # checked and remembered
    with torch.no_grad():
        bias.weight[0, 0] = float("nan")  # in place: a new version of the parameter
    with pytest.raises(ValueError, match=r"holds nan at entry \[0, 0\]"):
        relbias.attention(q, q, q, bias=bias)
    bias.weight = torch.nn.Parameter(torch.full((32, 2), float("inf")))  # replaced: another storage
    with pytest.raises(ValueError, match="holds inf"):
        relbias.attention(q, q, q, bias=bias)
