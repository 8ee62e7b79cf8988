import pytest
import torch

from relbias import relative_offsets, resolve_alignment


def test_default_alignment_puts_queries_on_the_last_keys():
    # queries at positions 2, 3, 4 against keys 0..4 (design.md: key_len - query_len + t)
    expected = torch.tensor([[2, 1, 0, -1, -2], [3, 2, 1, 0, -1], [4, 3, 2, 1, 0]])
    assert torch.equal(relative_offsets(3, 5), expected)


def test_explicit_positions():
    # queries at 10, 11 and keys at 3, 4, 5: offsets are i - j
    expected = torch.tensor([[7, 6, 5], [8, 7, 6]])
    assert torch.equal(relative_offsets(2, 3, query_start=10, key_start=3), expected)


def test_more_queries_than_keys_default_alignment():
    # Lq = 4 > Lk = 2: queries at -2, -1, 0, 1
    a = resolve_alignment(4, 2)
    assert a.query_start == -2
    assert torch.equal(relative_offsets(4, 2)[:, 0], torch.tensor([-2, -1, 0, 1]))


def test_alignment_offset_vector_covers_every_offset_once():
    a = resolve_alignment(3, 5, query_start=7, key_start=1)
    offsets = a.offsets()
    vec = a.offset_vector()
    assert a.num_offsets == 3 + 5 - 1 == vec.numel()
    assert vec[0] == offsets.min() == a.min_offset and vec[-1] == offsets.max() == a.max_offset
    assert torch.equal(torch.unique(offsets), vec)


def test_empty_lengths_give_no_offsets():
    assert resolve_alignment(0, 5).num_offsets == 0
    assert relative_offsets(0, 5).shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(query_len=-1, key_len=3), ValueError, "query_len must be >= 0, got -1"),
        (dict(query_len=2, key_len=2.0), TypeError, "key_len must be an int"),
        (dict(query_len=True, key_len=2), TypeError, "query_len must be an int"),
        (dict(query_len=2, key_len=2, query_start=1.5), TypeError, "query_start must be an int"),
    ],
)
def test_bad_lengths_and_positions_raise(kwargs, error, words):
    with pytest.raises(error, match=words):
        relative_offsets(**kwargs)
