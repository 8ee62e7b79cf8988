"""Benchmark: one decoding step (Lq queries, the last of Lk cached keys) and Hugging Face T5 generation.

Per-call latency (ms, median of ``--calls`` calls after a warm-up, the methods interleaved) of

* ``sdpa``: bias-free ``scaled_dot_product_attention`` with no mask (the 1.00x baseline: the least work);
* ``row+sdpa``: the bias rows materialised each call as Hugging Face's ``T5Attention.compute_bias`` does (its
  ``_relative_position_bucket``, an embedding lookup, a permute; plus the causal rule as -inf for several
  queries) and passed as ``attn_mask`` (transformers' T5 decoder computes it once per step and shares it over
  the layers);
* ``relbias``: ``relbias.attention`` with ``backend="auto"``, causal, the queries at the last positions;

for Lq in ``--queries`` (default 1) and Lk = 128, 512, 2048, 8192 (B=1, H=8, D=64, float32, causal ``T5Bias``),
inference; then tokens/s of greedy ``generate``
of a t5-small-shaped ``T5ForConditionalGeneration`` (random weights, built from a config: no download), patched
and unpatched, at 512 and 4096 input tokens (encoding included; the best of ``--rounds`` interleaved runs), with
identical tokens checked. Prints the load average before and after; run it on an otherwise idle machine.

    python benchmarks/bench_decode.py [--queries 1 16 128] [--lengths 128 512 2048 8192] [--inputs 512 4096]
        [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import relbias


def _median_ms(steps: dict, calls: int) -> dict:
    """Median wall time (ms) of each callable in ``steps``, interleaved round-robin after 20 warm-up rounds."""
    times = {name: [] for name in steps}
    for round_ in range(calls + 20):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if round_ >= 20:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def _hf_row(bias: relbias.T5Bias, key_len: int, query_len: int = 1):
    """The (1, H, Lq, Lk) bias rows of queries at positions Lk - Lq .. Lk - 1, computed as transformers'
    ``T5Attention.compute_bias`` does (``memory - context`` bucketed with logarithms, embedding, permute), with
    -inf on future keys when there are several queries (the causal mask transformers adds to them)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    context = torch.arange(key_len - query_len, key_len)[:, None]
    memory = torch.arange(key_len)[None, :]
    buckets = T5Attention._relative_position_bucket(
        memory - context, bidirectional=bias.bidirectional, num_buckets=bias.num_buckets,
        max_distance=bias.max_distance,
    )
    rows = F.embedding(buckets, bias.weight).permute(2, 0, 1)[None]
    return rows if query_len == 1 else rows.masked_fill(memory > context, float("-inf"))


def decode_steps(queries: list[int], lengths: list[int], calls: int) -> None:
    heads, dim = 8, 64
    bias = relbias.T5Bias(heads, bidirectional=False)
    with torch.no_grad():  # the benchmark's rows are the bias relbias uses
        torch.testing.assert_close(_hf_row(bias, 300, 4), bias(4, 300, query_start=296)[None].masked_fill(
            torch.ones(4, 300, dtype=torch.bool).triu(297), float("-inf")))
    print(f"{'Lq':>4} {'Lk':>6} {'sdpa ms':>9} {'row+sdpa ms':>12} {'relbias ms':>11} {'relbias/sdpa':>13} "
          f"{'row/relbias':>12}  backend")
    for lq in queries:
        for lk in (lk for lk in lengths if lk >= lq):
            q, k, v = torch.randn(1, heads, lq, dim), torch.randn(1, heads, lk, dim), torch.randn(1, heads, lk, dim)
            with torch.no_grad():
                steps = {
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=1.0),
                    "row": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=_hf_row(bias, lk, lq), scale=1.0),
                    "relbias": lambda: relbias.attention(q, k, v, bias=bias, is_causal=True, query_start=lk - lq),
                }
                ms = _median_ms(steps, calls)
                name = relbias.explain_backend(q, k, v, bias=bias, is_causal=True, query_start=lk - lq)[0]
            print(f"{lq:>4} {lk:>6} {ms['sdpa']:>9.3f} {ms['row']:>12.3f} {ms['relbias']:>11.3f} "
                  f"{ms['relbias'] / ms['sdpa']:>12.2f}x {ms['row'] / ms['relbias']:>11.2f}x  {name}")


def generation(inputs: list[int], new_tokens: int, rounds: int) -> None:
    import transformers

    from relbias.integrations.transformers import patch_t5

    config = transformers.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(config).eval()
    patched = patch_t5(transformers.T5ForConditionalGeneration(config).eval())
    patched.load_state_dict(plain.state_dict())
    print(f"{'input tokens':>12} {'unpatched tok/s':>16} {'patched tok/s':>14} {'patched/unpatched':>18}  same tokens")
    for n in inputs:
        ids = torch.randint(2, 32000, (1, n), generator=torch.Generator().manual_seed(n))
        settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        rates, outs = {}, {}
        with torch.no_grad():
            for name, model in (("plain", plain), ("patched", patched)) * rounds:
                start = time.perf_counter()
                outs[name] = model.generate(ids, **settings)
                rate = new_tokens / (time.perf_counter() - start)
                rates[name] = max(rates.get(name, 0.0), rate)  # best of the rounds, interleaved
        same = torch.equal(outs["plain"], outs["patched"])
        print(f"{n:>12} {rates['plain']:>16.1f} {rates['patched']:>14.1f} {rates['patched'] / rates['plain']:>17.2f}x  {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, nargs="+", default=[1], help="queries per call Lq (default 1)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192], help="cached keys Lk")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per method (median reported)")
    parser.add_argument("--inputs", type=int, nargs="*", default=[512, 4096], help="input tokens for generate")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy new tokens per generate")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved generate rounds per model (best reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"bench_decode: torch {torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()}")
    decode_steps(args.queries, args.lengths, args.calls)
    if args.inputs:
        generation(args.inputs, args.new_tokens, args.rounds)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
