"""Hostile arguments to every bias family and to the position helpers (issue 7)."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias import FunctionBias, PerOffsetBias, T5Bias
from relbias.biases import FAMILIES, make_bias
from relbias.biases.alibi import ALiBiBias
from relbias.biases.fire import FIREBias
from relbias.biases.kerple import KerpleLogBias, KerplePowerBias

HEADED = [T5Bias, ALiBiBias, KerpleLogBias, KerplePowerBias, FIREBias]


@pytest.mark.parametrize("cls", HEADED, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "num_heads, error, message",
    [(0, ValueError, "num_heads must be >= 1, got 0"), (-2, ValueError, "num_heads must be >= 1, got -2"),
     (True, TypeError, "num_heads must be an int, got True"), (2.0, TypeError, "num_heads must be an int, got 2.0"),
     ("2", TypeError, "num_heads must be an int, got '2'")],
)
def test_every_family_rejects_bad_head_counts(cls, num_heads, error, message):
    with pytest.raises(error, match=message):
        cls(num_heads)


@pytest.mark.parametrize(
    "max_len, error, message",
    [(0, ValueError, "max_len must be >= 1, got 0"), (True, TypeError, "max_len must be an int, got True"),
     (2.5, TypeError, "max_len must be an int, got 2.5")],
)
def test_per_offset_table_sizes(max_len, error, message):
    with pytest.raises(error, match=message):
        PerOffsetBias(max_len=max_len)


def test_per_offset_unknown_out_of_range_policy():
    with pytest.raises(ValueError, match=r"out_of_range must be one of \('error', 'clip'\), got 'wrap'"):
        PerOffsetBias(max_len=4, out_of_range="wrap")


@pytest.mark.parametrize("num_buckets", [2, 3, 7])
def test_causal_t5_accepts_odd_and_tiny_bucket_counts_and_matches_the_bucket_function(num_buckets):
    # causal buckets are not split in halves, so an odd count is valid; the bias must read t5_bucket's rows
    bias = T5Bias(2, num_buckets=num_buckets, max_distance=64, bidirectional=False, init_std=1.0)
    offsets = torch.arange(0, 100)
    buckets = relbias.t5_bucket(offsets, bidirectional=False, num_buckets=num_buckets, max_distance=64)
    assert int(buckets.max()) == num_buckets - 1  # every bucket is reachable
    torch.testing.assert_close(bias.offset_values(offsets), bias.weight[buckets].T, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [(dict(max_distance=128.0), TypeError, "max_distance must be an int, got 128.0"),
     (dict(max_distance=float("nan")), TypeError, "max_distance must be an int, got nan"),
     (dict(num_buckets=True), TypeError, "num_buckets must be an int, got True")],
)
def test_t5_bucket_settings_of_the_wrong_type(kwargs, error, message):
    with pytest.raises(error, match=message):
        T5Bias(2, **kwargs)


def test_t5_bucket_function_input_checks_and_extreme_offsets():
    with pytest.raises(TypeError, match="offset must be an integer tensor"):
        relbias.t5_bucket(torch.tensor([1.5]))
    # offsets at the ends of int64 land in the last bucket of each direction, not in an overflowed one
    big = torch.tensor([2**62, -(2**62), 2**63 - 1, -(2**63) + 1])
    assert relbias.t5_bucket(big).tolist() == [15, 31, 15, 31]
    assert relbias.t5_bucket(big, bidirectional=False).tolist() == [31, 0, 31, 0]


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda o: o, "must return a float tensor, got torch.int64"),
        (lambda o: o.to(torch.complex64), "must return a float tensor, got torch.complex64"),
        (lambda o: 3.0, "must return a float tensor, got float"),
        (lambda o: torch.zeros(2), r"returned shape \(2,\) for offsets of shape \(7,\); expected \(1, 7\)"),
        (lambda o: torch.where(o == 2, float("nan"), 0.0), "returned nan at offset 2; a bias must be finite"),
        (lambda o: torch.where(o == -1, float("inf"), 0.0), "returned inf at offset -1"),
        (lambda o: torch.where(o == 0, float("-inf"), 0.0), "returned -inf at offset 0.*hide keys with mask="),
    ],
    ids=["int", "complex", "scalar", "shape", "nan", "inf", "-inf"],
)
@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_function_bias_returning_bad_values_is_refused_by_every_backend(fn, message, backend):
    # before the fix a NaN/inf returned by the function silently turned the outputs into NaN
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(ValueError, match=message):
        relbias.attention(q, q, q, bias=FunctionBias(fn), backend=backend)


def test_positions_whose_offsets_overflow_int64_are_refused():
    q = torch.randn(1, 1, 4, 3)
    with pytest.raises(ValueError, match="positions and offsets must fit in int64"):
        relbias.attention(q, q, q, bias=T5Bias(1), query_start=2**62, key_start=-(2**62))
    with pytest.raises(ValueError, match="positions and offsets must fit in int64"):
        relbias.relative_offsets(2, 2, query_start=2**63 - 1)
    # large positions with a small offset are fine and equal the same block at 0 (T5 is offset-only)
    bias = T5Bias(1, init_std=1.0)
    far = relbias.attention(q, q, q, bias=bias, query_start=2**62, key_start=2**62)
    torch.testing.assert_close(far, relbias.attention(q, q, q, bias=bias), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [(dict(query_start=1.0), TypeError, "query_start must be an int, got 1.0"),
     (dict(key_start=True), TypeError, "key_start must be an int, got True"),
     (dict(is_causal=1), TypeError, "is_causal must be a bool, got 1"),
     (dict(scale=0), ValueError, "scale must be a positive finite number, got 0"),
     (dict(scale=float("nan")), ValueError, "scale must be a positive finite number, got nan"),
     (dict(scale=torch.tensor(0.5)), ValueError, "scale must be a positive finite number"),
     (dict(convention="t5", scale=2.0), ValueError, "convention 't5' uses unscaled scores"),
     (dict(convention="alibi"), ValueError, "convention must be one of"),
     (dict(backend="cuda"), ValueError, "unknown backend 'cuda'")],
)
def test_bad_keyword_arguments(kwargs, error, message):
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(error, match=message):
        relbias.attention(q, q, q, **kwargs)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_refuses_an_unknown_option_with_its_name(name):
    with pytest.raises(ValueError, match=f"bias family '{name}' does not take option 'colour'"):
        make_bias(name, num_heads=2, max_len=8, bidirectional=True, colour=1)
