import pytest
import torch

import relbias
from relbias import PerOffsetBias


def test_parameter_counts_answer_the_seed_question():
    assert PerOffsetBias.parameter_count(512, bidirectional=False) == 512
    assert PerOffsetBias.parameter_count(512, bidirectional=True) == 1023
    assert PerOffsetBias.parameter_count(512, bidirectional=True, num_heads=8) == 8184
    assert PerOffsetBias(max_len=10, bidirectional=False).num_parameters == 10
    assert PerOffsetBias(max_len=10, num_heads=3).num_parameters == 57
    assert sum(p.numel() for p in PerOffsetBias(max_len=10, num_heads=3).parameters()) == 57


def _with_weights(bias):
    with torch.no_grad():
        bias.weight.copy_(torch.arange(bias.weight.numel(), dtype=torch.float32).view_as(bias.weight))
    return bias


def test_materialised_bias_reads_u_of_the_offset():
    bias = _with_weights(PerOffsetBias(max_len=4, num_heads=2))  # rows: offsets -3..3, weight[r, h] = 2r + h
    out = bias(2, 3, query_start=5, key_start=4)  # offsets [[1, 0, -1], [2, 1, 0]]
    rows = torch.tensor([[1, 0, -1], [2, 1, 0]]) + 3
    assert torch.equal(out[0], 2.0 * rows) and torch.equal(out[1], 2.0 * rows + 1)


def test_causal_table_starts_at_offset_zero_and_future_keys_read_zero():
    bias = _with_weights(PerOffsetBias(max_len=3, bidirectional=False))  # rows: offsets 0, 1, 2
    out = bias(3, 3)
    assert torch.equal(out[0], torch.tensor([[0.0, 0, 0], [1, 0, 0], [2, 1, 0]]))


def test_offset_beyond_the_table_names_offset_and_largest_trained():
    bias = PerOffsetBias(max_len=4, bidirectional=False)
    with pytest.raises(ValueError, match=r"offset 5 has no parameter.*largest offset it knows is 3"):
        bias(6, 6)
    bi = PerOffsetBias(max_len=4)
    with pytest.raises(ValueError, match=r"offset (4|-4) has no parameter"):
        bi(5, 5)


def test_clipping_reuses_the_largest_trained_offset():
    bias = _with_weights(PerOffsetBias(max_len=3, out_of_range="clip"))  # rows: -2..2 -> values 0..4
    out = bias(1, 8, query_start=4)  # offsets 4, 3, ..., -3
    assert out[0, 0].tolist() == [4.0, 4, 4, 3, 2, 1, 0, 0]


def test_pairs_sharing_a_parameter_query_8_key_3():
    pairs = PerOffsetBias(max_len=12, bidirectional=False).pairs_sharing(8, 3, 12)
    assert pairs.tolist() == [[q, q - 5] for q in range(5, 12)]


def test_bias_depends_only_on_the_offset():
    bias = PerOffsetBias(max_len=20, num_heads=2, init_std=1.0)
    a = bias(5, 7, query_start=9, key_start=3)
    b = bias(5, 7, query_start=109 - 100, key_start=3)
    assert torch.equal(a, b)
    full = bias(10, 10)
    assert torch.equal(full[:, 1:, 1:], full[:, :-1, :-1])  # Toeplitz: constant along diagonals


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(max_len=0), ValueError, "max_len must be >= 1"),
        (dict(max_len=4.0), TypeError, "max_len must be an int"),
        (dict(max_len=4, num_heads=0), ValueError, "num_heads must be >= 1"),
        (dict(max_len=4, out_of_range="wrap"), ValueError, "out_of_range must be one of"),
        (dict(max_len=4, init_std=-1.0), ValueError, "init_std must be >= 0"),
    ],
)
def test_constructor_errors(kwargs, error, words):
    with pytest.raises(error, match=words):
        PerOffsetBias(**kwargs)


def test_attention_refuses_a_causal_bias_with_visible_future_keys():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="future keys"):
        relbias.attention(q, q, q, bias=PerOffsetBias(max_len=4, bidirectional=False))
    # with the causal mask the same call is fine
    relbias.attention(q, q, q, bias=PerOffsetBias(max_len=4, bidirectional=False), is_causal=True)
