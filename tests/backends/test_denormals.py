"""flush_denormals: on inside the block on every thread PyTorch computes on, off after it, the user's own
setting kept; and the toeplitz backend equal to the reference on scores deep in float32's denormal range."""

from __future__ import annotations

import torch

import relbias
from relbias.backends._shared.denormals import flush_denormals

DENORMAL = 1e-40  # below float32's smallest normal, 1.18e-38


def _denormals_left(threads: int) -> int:
    """How many of a tensor's denormal entries survive ``* 1.0``, computed on ``threads`` threads (each
    thread of the OpenMP team takes a contiguous chunk)."""
    torch.set_num_threads(threads)
    x = torch.full((1 << 21,), DENORMAL)
    return int((x * 1.0 != 0).sum())


def test_every_thread_flushes_inside_and_none_after():
    threads = max(2, torch.get_num_threads())
    assert _denormals_left(threads) == 1 << 21  # the default: denormals kept
    with flush_denormals():
        assert _denormals_left(threads) == 0  # the workers flush too, not only this thread
    assert _denormals_left(threads) == 1 << 21


def test_a_user_who_flushes_already_keeps_flushing():
    torch.set_flush_denormal(True)
    try:
        with flush_denormals():
            pass
        assert float(torch.tensor(DENORMAL) * 1.0) == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert float(torch.tensor(DENORMAL) * 1.0) != 0.0


def test_toeplitz_matches_the_reference_where_exp_lands_in_denormals():
    # a per-offset bias falling to -100 logits over the table: exp(s - max) passes through 2^-149..2^-126
    n, heads = 300, 2
    bias = relbias.PerOffsetBias(max_len=n, num_heads=heads, bidirectional=False)
    with torch.no_grad():
        bias.weight.copy_(-torch.linspace(0, 100, n)[:, None].expand(n, heads) * torch.tensor([1.0, 0.4]))
    q, k, v = (torch.randn(1, heads, n, 16, requires_grad=True) for _ in range(3))
    grads = {}
    for backend in ("toeplitz", "reference"):
        out = relbias.attention(q, k, v, bias=bias, is_causal=True, convention="additive", backend=backend)
        grads[backend] = [out, *torch.autograd.grad(out.sum(), [q, k, v, bias.weight])]
    for got, want in zip(grads["toeplitz"], grads["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_two_python_threads_leave_no_flushing_behind():
    # each Python thread has its own OpenMP team; the mode travels with each call, so one thread's exit
    # cannot turn flushing back on for the other's team after that one's call returned
    import threading

    bias, q = relbias.ALiBiBias(num_heads=1), torch.randn(1, 1, 4, 4)
    leaks = [0, 0]

    def work(index):
        torch.set_num_threads(2)
        for _ in range(100):
            with flush_denormals():
                relbias.attention(q, q, q, bias=bias, backend="toeplitz")
            if float(torch.tensor(DENORMAL) * 1.0) == 0.0:
                leaks[index] += 1
                torch.set_flush_denormal(False)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert leaks == [0, 0]


def test_the_native_kernels_leave_every_threads_mode_as_they_found_it():
    # the kernels flush on each of their threads and restore that thread's mode: every thread computes as before the
    # call, with the default (denormals kept) and for a user who flushes already
    from relbias.backends.toeplitz import _native

    if _native.load_native() is None:
        import pytest

        pytest.skip(f"native kernels unavailable: {_native.native_unavailable_reason()}")
    threads = max(2, torch.get_num_threads())
    torch.set_num_threads(threads)
    bias = relbias.ALiBiBias(num_heads=4)
    q, k, v = (torch.randn(2, 4, 600, 16, requires_grad=True) for _ in range(3))
    for user_flushes in (False, True):
        torch.set_flush_denormal(user_flushes)
        try:
            before = _denormals_left(threads)
            assert user_flushes or before == 1 << 21
            out = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="toeplitz")
            assert _denormals_left(threads) == before
            out.sum().backward()
            assert _denormals_left(threads) == before
        finally:
            torch.set_flush_denormal(False)
