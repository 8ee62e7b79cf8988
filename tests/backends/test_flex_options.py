"""flex's kernel options for half precision on a GPU: chosen from the device's shared memory, retried once at
smaller blocks when inductor finds no configuration that fits (the choice logic runs here without a GPU; the
compiled function is replaced by one that fails as inductor does)."""

from __future__ import annotations

import itertools

import pytest
import torch

from relbias.backends import flex
from relbias.backends.flex import _options

LIMITS = (232448, 101376, 49152)  # H100/H200, sm86 (A10G, RTX 30x0), 48 KiB
HALF = (torch.bfloat16, torch.float16)
#: inductor's message when a config exceeds an H200's shared memory (seen with flex, bfloat16, a per-offset bias)
OUT_OF_SHARED_MEMORY = ("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
                        "Required: 311296 Hardware limit: 232448 Reducing block sizes or `num_stages` may help.")


def _estimates(options, dtype, head_dim, value_dim):
    item = torch.empty((), dtype=dtype).element_size()
    fwd = _options.forward_bytes(options["fwd_BLOCK_M"], options["fwd_BLOCK_N"], options["fwd_num_stages"], item,
                                 head_dim, value_dim)
    if "bwd_BLOCK_M1" not in options:
        return fwd, None
    bwd = _options.backward_bytes(*(options[f"bwd_{n}"] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
                                                                    "num_stages")), item, head_dim, value_dim)
    return fwd, bwd


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_the_choice_fits_the_device_with_the_margin_and_shrinks_with_it(dtype, head_dim):
    chosen = [_options.choose(limit, dtype, head_dim, head_dim, backward=True) for limit in LIMITS]
    smallest = (_options.FORWARD[-1][:3], _options.BACKWARD[-1][:5])
    for limit, options in zip(LIMITS, chosen):
        fwd, bwd = _estimates(options, dtype, head_dim, head_dim)
        if (options["fwd_BLOCK_M"], options["fwd_BLOCK_N"], options["fwd_num_stages"]) != smallest[0]:
            assert fwd * _options.MARGIN <= limit, (limit, options)
        assert bwd * _options.MARGIN <= limit or options["bwd_BLOCK_M1"] == smallest[1][0], (limit, options)
        for name, size in options.items():
            if "BLOCK" in name:
                assert 128 % size == 0, (name, size)  # FlexAttention's sparse block is 128 tokens
    for larger, smaller in itertools.pairwise(chosen):  # less shared memory never gets larger tiles
        assert all(b <= a for a, b in zip(_estimates(larger, dtype, head_dim, head_dim),
                                            _estimates(smaller, dtype, head_dim, head_dim)))
    # a candidate larger than the choice would not have fitted: the choice is the largest that does
    first = _options.choose(LIMITS[0], dtype, head_dim, head_dim, backward=False)
    index = [c[:2] for c in _options.FORWARD].index((first["fwd_BLOCK_M"], first["fwd_BLOCK_N"]))
    item = torch.empty((), dtype=dtype).element_size()
    for candidate in _options.FORWARD[:index]:
        assert _options.forward_bytes(*candidate[:3], item, head_dim, head_dim) * _options.MARGIN > LIMITS[0]


def test_without_gradients_no_backward_options_are_given():
    assert not any(k.startswith("bwd_") for k in _options.choose(LIMITS[0], torch.bfloat16, 64, 64, backward=False))


def test_the_retry_factor_is_the_reported_requirement_over_the_limit_and_at_least_two():
    assert _options.retry_factor(RuntimeError(OUT_OF_SHARED_MEMORY)) == 2.0  # 311296 / 232448 = 1.34
    bigger = OUT_OF_SHARED_MEMORY.replace("311296", "697344")
    assert _options.retry_factor(RuntimeError(bigger)) == pytest.approx(697344 / 232448)
    assert _options.retry_factor(RuntimeError("No valid triton configs. PassManager::run failed")) == 2.0
    assert _options.retry_factor(RuntimeError("CUDA error: an illegal memory access was encountered")) is None


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_retry_takes_strictly_smaller_candidates_down_to_the_smallest(dtype):
    options = _options.choose(LIMITS[0], dtype, 64, 64, backward=True)
    seen = [options]
    for _ in range(len(_options.FORWARD) + len(_options.BACKWARD)):
        options = _options.shrink(options, LIMITS[0], dtype, 64, 64, factor=1.0)  # factor 1: only "smaller" acts
        seen.append(options)
    for before, after in itertools.pairwise(seen):
        fwd0, bwd0 = _estimates(before, dtype, 64, 64)
        fwd1, bwd1 = _estimates(after, dtype, 64, 64)
        assert (fwd1 < fwd0 or after["fwd_BLOCK_M"] == _options.FORWARD[-1][0]) and fwd1 <= fwd0
        assert (bwd1 < bwd0 or after["bwd_BLOCK_M1"] == _options.BACKWARD[-1][0]) and bwd1 <= bwd0
    assert seen[-1]["fwd_BLOCK_N"] == _options.FORWARD[-1][1] and seen[-1]["bwd_BLOCK_N1"] == _options.BACKWARD[-1][1]


def _sdpa(q, k, v):
    """SDPA on float64 copies, in q's dtype (torch's bfloat16 CPU kernel needs AVX-512: .ci/numerics runs without)."""
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()).to(q.dtype)


class _Inductor:
    """Stands in for compiled FlexAttention: records each call's kernel_options and the backward lowering flag, and
    raises ``errors`` in turn (None: returns SDPA's output)."""

    def __init__(self, *errors):
        self.errors, self.calls = list(errors), []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append((kwargs.get("kernel_options"),
                           torch._functorch.config.force_non_lazy_backward_lowering))
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return _sdpa(q, k, v)


@pytest.fixture
def gpu_like(monkeypatch):
    """flex on a device that reports an H200's shared memory, with fresh options."""
    monkeypatch.setattr(flex, "COMPILE", True)
    monkeypatch.setattr(flex, "_OPTIONS", {})
    monkeypatch.setattr(_options, "shared_memory", lambda device: LIMITS[0])

    def install(fake):
        monkeypatch.setattr(flex, "_compiled", lambda: fake)
        return fake

    return install


def test_an_out_of_shared_memory_compile_is_retried_once_with_smaller_blocks_which_later_calls_keep(gpu_like):
    fake = gpu_like(_Inductor(RuntimeError(OUT_OF_SHARED_MEMORY)))
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    out = flex._run(q, q, q, backward=True)
    torch.testing.assert_close(out, _sdpa(q, q, q))
    (first, lowered_first), (second, lowered_second) = fake.calls
    assert lowered_first and lowered_second  # the backward compiled with the forward, so its errors reach the retry
    assert first == _options.choose(LIMITS[0], torch.bfloat16, 64, 64, backward=True)
    estimates = (_estimates(options, torch.bfloat16, 64, 64) for options in (first, second))
    assert all(s < f for f, s in zip(*estimates))
    flex._run(q, q, q, backward=True)
    assert fake.calls[-1][0] == second  # kept for the process
    flex._run(q, q, q)
    assert fake.calls[-1] == (_options.choose(LIMITS[0], torch.bfloat16, 64, 64, backward=False), False)


def test_a_second_failure_and_other_errors_are_raised_as_they_are(gpu_like):
    q = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    fake = gpu_like(_Inductor(*[RuntimeError(OUT_OF_SHARED_MEMORY)] * 3))
    with pytest.raises(RuntimeError, match="No valid triton configs"):
        flex._run(q, q, q)
    assert len(fake.calls) == 2
    with pytest.raises(RuntimeError, match="No valid triton configs"):  # retried once in the process: not again
        flex._run(q, q, q)
    assert len(fake.calls) == 3 and fake.calls[2][0] == fake.calls[1][0]
    fake = gpu_like(_Inductor(RuntimeError("CUDA error: an illegal memory access was encountered")))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        flex._run(q, q, q)
    assert len(fake.calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float32_and_cpu_calls_keep_inductors_defaults(gpu_like, dtype, monkeypatch):
    fake = gpu_like(_Inductor())
    q = torch.randn(1, 2, 128, 64, dtype=dtype)
    flex._run(q, q, q)
    monkeypatch.setattr(_options, "shared_memory", lambda device: None)  # what a CPU reports
    flex._run(q.bfloat16(), q.bfloat16(), q.bfloat16())
    assert [options for options, _ in fake.calls] == [None, None]


def test_short_query_lengths_get_no_forward_options(gpu_like):
    """Below 128 padded queries inductor runs its decoding kernel, which sizes its query block from the length: a
    fwd_BLOCK_M would override that past the rows that exist."""
    fake = gpu_like(_Inductor())
    short = torch.randn(1, 2, flex.DECODING_BELOW // 2, 64, dtype=torch.bfloat16)
    flex._run(short, short, short)
    flex._run(short, short, short, backward=True)
    chosen = _options.choose(LIMITS[0], torch.bfloat16, 64, 64, backward=True)
    assert fake.calls[0][0] is None
    assert fake.calls[1][0] == {k: v for k, v in chosen.items() if k.startswith("bwd_")}


def test_hostile_numbers_give_a_bounded_factor_and_never_a_larger_candidate():
    huge = OUT_OF_SHARED_MEMORY.replace("311296", "1" + "0" * 400)
    assert _options.retry_factor(RuntimeError(huge)) == 1e6
    several = "No valid triton configs. Required: 100 Hardware limit: 232448; Required: 2000000 Hardware limit: 232448"
    assert _options.retry_factor(RuntimeError(several)) == pytest.approx(2000000 / 232448)
    assert _options.choose(LIMITS[0], torch.bfloat16, 64, 64, True, factor=0) == \
        _options.choose(LIMITS[0], torch.bfloat16, 64, 64, True)
    chosen = _options.choose(LIMITS[0], torch.bfloat16, 64, 64, False)
    assert _options.shrink({"fwd_BLOCK_M": 96}, LIMITS[0], torch.bfloat16, 64, 64, 1.0) == chosen


def test_a_cpu_reports_no_shared_memory():
    assert _options.shared_memory(torch.device("cpu")) is None
