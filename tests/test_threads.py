"""One bias and one layer shared by threads: four threads decoding at different lengths at once give, bit for bit,
what the same calls give run one after another (the same code path, so the same bits)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

import relbias
from relbias.nn import KVCache, MultiheadAttention, StaticKVCache

THREADS = 4


def _decode(layer: MultiheadAttention, x: torch.Tensor, cache) -> torch.Tensor:
    """A prefill of a third of ``x``, then one token per step, each step reading ``cache``: (B, L, E)."""
    first = x.shape[1] // 3
    outs = [layer(x[:, :first], need_weights=False, cache=cache)[0]]
    outs += [layer(x[:, t : t + 1], need_weights=False, cache=cache)[0] for t in range(first, x.shape[1])]
    return torch.cat(outs, 1)


def _jobs():
    """Per thread: a sequence of its own length and its own cache (a KVCache or a StaticKVCache, a window on two)."""
    generator = torch.Generator().manual_seed(0)
    lengths = (37, 64, 90, 129)
    return [(torch.randn(2, n, 32, generator=generator), i % 2, i >= 2) for i, n in enumerate(lengths)]


def test_one_bias_and_layer_decoding_in_four_threads_equal_sequential_runs():
    torch.manual_seed(0)
    bias = relbias.T5Bias(4, num_buckets=16, max_distance=64, bidirectional=False, init_std=1.0)
    layers = {window: MultiheadAttention(32, 4, batch_first=True, position_bias=bias, is_causal=True,
                                         window=(15, 0) if window else None).eval() for window in (False, True)}

    def run(job):
        x, static, window = job
        cache = StaticKVCache(2, 4, x.shape[1], 8) if static else KVCache()
        with torch.no_grad():
            return _decode(layers[window], x, cache)

    jobs = _jobs()
    sequential = [run(job) for job in jobs]
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(2):  # twice: the second round meets warm caches of the bias (its tables, its lookups)
            concurrent = list(pool.map(run, jobs))
            for got, want in zip(concurrent, sequential):
                assert torch.equal(got, want)
    full = layers[False](jobs[0][0], need_weights=False)[0]  # and decoding is what the full forward computes
    torch.testing.assert_close(sequential[0], full, rtol=1e-5, atol=1e-5)


def test_one_bias_in_four_threads_with_gradients_equals_sequential_runs():
    torch.manual_seed(0)
    bias = relbias.PerOffsetBias(max_len=200, num_heads=4, bidirectional=True, out_of_range="error")
    with torch.no_grad():
        bias.weight.normal_()
    generator = torch.Generator().manual_seed(1)
    inputs = [tuple(torch.randn(1, 4, n, 16, generator=generator) for _ in range(3)) for n in (33, 70, 128, 150)]

    def run(qkv):
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        out = relbias.attention(q, k, v, bias=bias)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias.weight))
        return [out.detach(), *grads]

    sequential = [run(qkv) for qkv in inputs]
    with ThreadPoolExecutor(THREADS) as pool:
        concurrent = list(pool.map(run, inputs))
    for got, want in zip(concurrent, sequential):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
