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


def test_tensor_positions_are_read_as_ints_in_eager_mode():
    # a static KV cache counts its tokens in a 0-dim int64 tensor
    a = resolve_alignment(2, 6, query_start=torch.tensor(4), key_start=torch.tensor(1, dtype=torch.int32))
    assert (a.query_start, a.key_start) == (4, 1) and type(a.query_start) is int and type(a.key_start) is int
    assert torch.equal(relative_offsets(2, 6, query_start=torch.tensor(4)), relative_offsets(2, 6, query_start=4))


@pytest.mark.parametrize(
    "position", [torch.tensor([3]), torch.tensor(3.0), torch.tensor(True)], ids=["1-d", "float", "bool"]
)
def test_bad_tensor_positions_raise(position):
    with pytest.raises(TypeError, match=r"query_start must be an int or a 0-dim integer tensor, got a tensor of shape"):
        resolve_alignment(2, 2, query_start=position)


def test_tensor_positions_stay_tensors_under_compile():
    """Compiled, a tensor position is never read: one graph serves every position, and the offsets are right."""
    torch._dynamo.reset()

    def offsets(query_start):
        a = resolve_alignment(2, 6, query_start=query_start)
        return a.offsets(), a.offset_vector(), a.min_offset, a.max_offset, isinstance(a.query_start, torch.Tensor)

    compiled = torch.compile(offsets, fullgraph=True, backend="eager")
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    for start in (0, 3, 4, -7, 2**40):
        got, vector, lo, hi, kept_a_tensor = compiled(torch.tensor(start))
        assert kept_a_tensor
        want = resolve_alignment(2, 6, query_start=start)
        assert torch.equal(got, want.offsets()) and torch.equal(vector, want.offset_vector())
        assert (int(lo), int(hi)) == (want.min_offset, want.max_offset)
    assert counters["stats"]["unique_graphs"] - before == 1
    torch._dynamo.reset()
