"""A bias module that has run a decoding step (its native form memoised, with the native kernel's handle) copies,
pickles and saves like any module, and the copies compute what the original computes."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import relbias
from relbias.biases import make_bias


@pytest.mark.parametrize("family", ["t5", "offset", "alibi", "kerple_log"])
def test_copies_after_a_decoding_step_give_the_same_output(family):
    bias = make_bias(family, num_heads=4, max_len=64, bidirectional=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 4, 40, 16, generator=gen), \
        torch.randn(1, 4, 40, 16, generator=gen)
    with torch.no_grad():
        assert relbias.explain_backend(q, k, v, bias=bias, is_causal=True)[0] == "decode"
        want = relbias.attention(q, k, v, bias=bias, is_causal=True)  # memoises the native form
    buffer = io.BytesIO()
    torch.save(bias, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(bias), pickle.loads(pickle.dumps(bias)), torch.load(buffer, weights_only=False)]
    for other in copies:
        assert "_native_memo" not in other.__dict__
        with torch.no_grad():
            torch.testing.assert_close(relbias.attention(q, k, v, bias=other, is_causal=True), want, rtol=0, atol=0)
    assert bias.state_dict().keys() == copies[0].state_dict().keys()
