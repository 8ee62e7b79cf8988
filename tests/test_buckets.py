import pytest
import torch

from relbias import t5_bucket, t5_bucket_ranges, validate_t5_buckets

# design.md §4 (T5, num_buckets=32, max_distance=128)
OFFSETS = [200, 128, 20, 8, 1, 0, -1, -8, -20, -128, -200]
BIDIRECTIONAL = [15, 15, 10, 8, 1, 0, 17, 24, 26, 31, 31]
CAUSAL = [31, 31, 17, 8, 1, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("bidirectional, expected", [(True, BIDIRECTIONAL), (False, CAUSAL)])
def test_design_md_golden_values(bidirectional, expected):
    got = t5_bucket(torch.tensor(OFFSETS), bidirectional=bidirectional)
    assert got.tolist() == expected


def test_float32_boundaries_match_hugging_face_rounding():
    # Exact arithmetic puts distance 16 at the start of bucket 9 + 1 and 64 at 13 + 1 only just;
    # float32 (as HF computes) decides: 16 -> 10, 64 -> 14 bidirectional (our own golden values).
    assert t5_bucket(torch.tensor([16, 64, 15, 63])).tolist() == [10, 14, 9, 13]
    assert t5_bucket(torch.tensor([-16, -64])).tolist() == [26, 30]


def test_last_bucket_starts_at_91_bidirectional_and_113_causal():
    bi = t5_bucket_ranges(bidirectional=True)
    ca = t5_bucket_ranges(bidirectional=False)
    assert bi[15] == (15, 91, None) and bi[31] == (31, None, -91)
    assert ca[31] == (31, 113, None)
    assert t5_bucket(90) == 14 and t5_bucket(91) == 15
    assert t5_bucket(112, bidirectional=False) == 30 and t5_bucket(113, bidirectional=False) == 31


def test_bucket_16_is_never_used_bidirectionally():
    buckets = t5_bucket(torch.arange(-5000, 5001))
    assert 16 not in buckets.tolist()
    assert set(buckets.tolist()) == set(range(32)) - {16}
    assert t5_bucket_ranges()[16] == (16, None, None)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (64, 256), (16, 40), (8, 20)])
def test_ranges_agree_with_the_bucket_function(bidirectional, num_buckets, max_distance):
    cfg = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    offsets = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    buckets = t5_bucket(offsets, **cfg)
    for b, lo, hi in t5_bucket_ranges(**cfg):
        inside = torch.ones_like(offsets, dtype=torch.bool)
        if lo is not None:
            inside &= offsets >= lo
        if hi is not None:
            inside &= offsets <= hi
        if lo is None and hi is None:
            inside[:] = False
        expected = buckets == b
        if not bidirectional and b == 0:
            expected &= offsets >= 0  # future offsets also read bucket 0 when causal
        assert torch.equal(inside, expected), b


def test_distances_are_monotone_in_bucket():
    d = torch.arange(0, 20000)
    for bidirectional in (True, False):
        b = t5_bucket(d, bidirectional=bidirectional)
        assert bool((b[1:] >= b[:-1]).all())


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_buckets=0), "num_buckets >= 4"),
        (dict(num_buckets=1, bidirectional=False), "num_buckets >= 2"),
        (dict(num_buckets=33), "odd num_buckets=33"),
        (dict(num_buckets=32, max_distance=8), "larger than the exact region"),
        (dict(num_buckets=32, max_distance=5), "got max_distance=5"),
        (dict(num_buckets=32, max_distance=10), "would never be used"),
        (dict(num_buckets=4, max_distance=1), "larger than the exact region"),
    ],
)
def test_invalid_configurations_say_why(kwargs, words):
    cfg = dict(bidirectional=True, num_buckets=32, max_distance=128) | kwargs
    with pytest.raises(ValueError, match=words):
        t5_bucket(torch.tensor([0]), **cfg)


def test_small_but_valid_configurations():
    # smallest valid settings: causal 2 buckets, bidirectional 4 buckets
    assert t5_bucket(torch.tensor([0, 1, 5]), bidirectional=False, num_buckets=2, max_distance=3).tolist() == [0, 1, 1]
    assert t5_bucket(torch.tensor([0, 1, -1, -9]), num_buckets=4, max_distance=2).tolist() == [0, 1, 3, 3]


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([True]), 1.5, True])
def test_non_integer_offsets_are_rejected(bad):
    with pytest.raises(TypeError, match="offset"):
        t5_bucket(bad)


def test_settings_types():
    with pytest.raises(TypeError, match="num_buckets must be an int"):
        validate_t5_buckets(bidirectional=True, num_buckets=32.0, max_distance=128)
    with pytest.raises(TypeError, match="bidirectional must be a bool"):
        validate_t5_buckets(bidirectional=1, num_buckets=32, max_distance=128)


@pytest.fixture
def hf_bucket():
    hf_t5 = pytest.importorskip(
        "transformers.models.t5.modeling_t5", reason="transformers (the dev/hf extra) is not installed"
    )

    def bucket(offsets, **cfg):
        # Hugging Face's relative_position is key_pos - query_pos = -offset
        return hf_t5.T5Attention._relative_position_bucket(
            -offsets, cfg["bidirectional"], cfg["num_buckets"], cfg["max_distance"]
        )

    return bucket


SHIPPED = [(32, 128), (64, 256), (32, 256), (64, 128), (128, 1024), (16, 64), (8, 20), (6, 7)]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", SHIPPED + [(4, 2)])
def test_equal_to_hugging_face_for_every_offset_up_to_100000(hf_bucket, bidirectional, num_buckets, max_distance):
    cfg = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    if (num_buckets, max_distance, bidirectional) == (4, 2, False):
        cfg["max_distance"] = 3  # causal 4 buckets: the exact region is 0, 1, so max_distance must be > 2
    offsets = torch.arange(-100_000, 100_001)
    assert torch.equal(t5_bucket(offsets, **cfg), hf_bucket(offsets, **cfg))


def test_equal_to_hugging_face_for_random_valid_configurations(hf_bucket):
    g = torch.Generator().manual_seed(1)
    offsets = torch.arange(-3000, 3001)
    checked = 0
    while checked < 40:
        num_buckets = int(torch.randint(2, 200, (1,), generator=g))
        max_distance = int(torch.randint(2, 2000, (1,), generator=g))
        bidirectional = bool(torch.randint(0, 2, (1,), generator=g))
        cfg = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
        try:
            validate_t5_buckets(**cfg)
        except ValueError:
            continue
        assert torch.equal(t5_bucket(offsets, **cfg), hf_bucket(offsets, **cfg)), cfg
        checked += 1
