"""RelativeBias.native reuses its last result outside autograd while the block and the module's state are
unchanged (a decoder's layers share one bias per step), and never a stale or graph-less one."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.biases import make_bias


def _values(bias, **kwargs):
    return bias.native(3, 40, query_start=37, **kwargs).values


@pytest.mark.parametrize("family", ["t5", "offset", "alibi", "kerple_log"])
def test_a_repeated_inference_call_reuses_the_values_and_a_changed_parameter_does_not(family):
    bias = make_bias(family, num_heads=2, max_len=64, bidirectional=True)
    with torch.no_grad():
        first = _values(bias)
        assert _values(bias) is first  # the same block: reused
        assert _values(bias, key_start=1) is not first  # another block: computed
        for p in bias.parameters():
            p.add_(1.0)  # an optimizer step (in place: the version counter moves)
        fresh = _values(bias)
    if list(bias.parameters()):
        assert not torch.equal(fresh, first)
    want = bias.offset_values(torch.arange(37 - 39, 37 + 3))  # offsets min..max of the 3 x 40 block
    torch.testing.assert_close(fresh, want)


def test_load_state_dict_and_dtype_changes_are_seen():
    bias = relbias.T5Bias(2, bidirectional=True)
    with torch.no_grad():
        first = _values(bias)
        bias.load_state_dict({"weight": torch.randn(32, 2)})
        assert not torch.equal(_values(bias), first)
        bias.double()
        assert _values(bias).dtype == torch.float64


def test_values_that_need_a_graph_are_never_reused():
    bias = relbias.T5Bias(2, bidirectional=True)
    with torch.no_grad():
        cached = _values(bias)
    with_grad = _values(bias)
    assert with_grad is not cached and with_grad.requires_grad
    with_grad.sum().backward()
    assert bias.weight.grad is not None and float(bias.weight.grad.abs().sum()) > 0


def test_an_inference_mode_result_is_not_handed_to_autograd_later():
    bias = relbias.T5Bias(2, bidirectional=True).requires_grad_(False)  # frozen: no graph, the memo may serve
    with torch.inference_mode():
        inside = _values(bias)
    outside = _values(bias)
    assert inside.is_inference() and not outside.is_inference()
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 2, 40, 8)
    relbias.attention(q, k, k, bias=bias, query_start=37).sum().backward()  # saves the values for backward
    assert q.grad is not None


def test_a_function_bias_is_never_reused():
    scale = torch.tensor(1.0)
    bias = relbias.FunctionBias(lambda o: scale * o.float(), bidirectional=True)
    with torch.no_grad():
        first = _values(bias)
        scale.fill_(2.0)  # state the module does not own: only a fresh call sees it
        torch.testing.assert_close(_values(bias), 2 * first)
