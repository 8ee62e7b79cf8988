"""Benchmark: one decoding step (Lq queries, the last of Lk cached keys) and Hugging Face T5 generation.

Per-call latency (ms, median of ``--calls`` calls after a warm-up, the methods interleaved) of

* ``sdpa``: bias-free ``scaled_dot_product_attention`` with no mask (the 1.00x baseline: the least work);
* ``row+sdpa``: the bias rows materialised each call as Hugging Face's ``T5Attention.compute_bias`` does (its
  ``_relative_position_bucket``, an embedding lookup, a permute; plus the causal rule as -inf for several
  queries) and passed as ``attn_mask`` (transformers' T5 decoder computes it once per step and shares it over
  the layers);
* ``relbias``: ``relbias.attention`` with ``backend="auto"``, causal, the queries at the last positions;

for Lq in ``--queries`` (default 1) and Lk = 128, 512, 2048, 8192 (B=1, H=8, D=64, ``--dtype`` (default float32;
bfloat16 and float16 too: the cache and queries in that dtype, the materialised rows rounded to it as transformers'
half-precision models do), causal ``T5Bias``), inference. With ``--loop N``, also back-to-back: the best of 7 runs of N
calls of one method in a row (us per call, the methods alternating between runs), where caches and the interpreter stay
warm (a repeated call's floor; inside a model every call is colder), and relbias' time over SDPA's in us. Then tokens/s
of greedy ``generate`` (``--new-tokens`` tokens; the prompt's forward included) of a t5-small-shaped
``T5ForConditionalGeneration`` and a bloom-560m-shaped ``BloomForCausalLM`` with 6 layers (random weights, built from
configs: no download) at 512 and 4096 input tokens: unpatched, patched, and the bound (patched, with the attention call
returning its query: what the model costs when attention costs nothing), interleaved in one process, the best of
``--rounds`` rounds each, with identical tokens checked. The ratios are medians over the rounds of each round's own
ratio (the three variants of a round run back to back, so a slower or faster stretch of a shared machine moves them
together), and ``share of bound`` is ``(unpatched/patched - 1) / (unpatched/bound - 1)`` of those: the part of the most
any attention could gain that the patch gains. Prints the load average before and after; run it on an otherwise idle
machine.

    python benchmarks/bench_decode.py [--queries 1 16 128] [--lengths 128 512 2048 8192] [--inputs 512 4096]
        [--models t5 bloom] [--new-tokens 32] [--loop 2000] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
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


def _loop_us(steps: dict, calls: int, runs: int = 7) -> dict:
    """Per-call wall time (us) of each callable in ``steps``: the best of ``runs`` runs of ``calls`` calls in a row,
    the callables alternating between runs."""
    best = {name: float("inf") for name in steps}
    for _ in range(runs):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


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


def decode_steps(queries: list[int], lengths: list[int], calls: int, loop: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
    heads, dim = 8, 64
    bias = relbias.T5Bias(heads, bidirectional=False)
    with torch.no_grad():  # the benchmark's rows are the bias relbias uses
        torch.testing.assert_close(_hf_row(bias, 300, 4), bias(4, 300, query_start=296)[None].masked_fill(
            torch.ones(4, 300, dtype=torch.bool).triu(297), float("-inf")))
    looped = f"  {'sdpa us, loop':>13} {'relbias us, loop':>16} {'+us':>5}" if loop else ""
    print(f"{'Lq':>4} {'Lk':>6} {'sdpa ms':>9} {'row+sdpa ms':>12} {'relbias ms':>11} {'relbias/sdpa':>13} "
          f"{'row/relbias':>12}  {'backend':<8}{looped}".rstrip())
    for lq in queries:
        for lk in (lk for lk in lengths if lk >= lq):
            q, k, v = (torch.randn(1, heads, n, dim).to(dtype) for n in (lq, lk, lk))
            with torch.no_grad():
                steps = {
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=1.0),
                    "row": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=_hf_row(bias, lk, lq).to(dtype),
                                                                  scale=1.0),
                    "relbias": lambda: relbias.attention(q, k, v, bias=bias, is_causal=True, query_start=lk - lq),
                }
                ms = _median_ms(steps, calls)
                name = relbias.explain_backend(q, k, v, bias=bias, is_causal=True, query_start=lk - lq)[0]
                us = _loop_us({n: steps[n] for n in ("sdpa", "relbias")}, loop) if loop else None
            looped = f"  {us['sdpa']:>13.1f} {us['relbias']:>16.1f} {us['relbias'] - us['sdpa']:>5.1f}" if us else ""
            row = (f"{lq:>4} {lk:>6} {ms['sdpa']:>9.3f} {ms['row']:>12.3f} {ms['relbias']:>11.3f} "
                   f"{ms['relbias'] / ms['sdpa']:>12.2f}x {ms['row'] / ms['relbias']:>11.2f}x  {name:<8}{looped}")
            print(row.rstrip())


def _models(family: str):
    """(unpatched, patched) copies of one model with random weights (seed 0), built from a config (no download):
    ``t5``: a t5-small-shaped ``T5ForConditionalGeneration``; ``bloom``: a bloom-560m-shaped ``BloomForCausalLM``
    with 6 layers and a 1024-token vocabulary."""
    import transformers

    from relbias.integrations.transformers import patch

    torch.manual_seed(0)
    if family == "t5":
        config = transformers.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128,
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
        build = transformers.T5ForConditionalGeneration
    else:
        config = transformers.BloomConfig(vocab_size=1024, hidden_size=1024, n_layer=6, n_head=16)
        build = transformers.BloomForCausalLM
    plain = build(config).eval()
    patched = patch(build(config).eval())
    patched.load_state_dict(plain.state_dict())
    return plain, patched


class _FreeAttention:
    """While active, the patched layers' attention call returns its query (B, H, Lq, D): attention costs nothing,
    everything around it (projections, feed-forward, cache, masks, relbias' per-layer bookkeeping) runs as patched."""

    def __enter__(self):
        from relbias.integrations import alibi_common, t5_attention

        self.saved = [(m, m.attention) for m in (alibi_common, t5_attention)]
        for module, _ in self.saved:
            module.attention = lambda query, key, value, **kwargs: query
        return self

    def __exit__(self, *exc):
        for module, function in self.saved:
            module.attention = function


class _LayerTimes:
    """While active, the wall time (us) of every decoder self-attention layer call that decodes one token (the
    layer's whole forward: projections, cache update, bias, attention, output projection), by forward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for n, m in model.named_modules()  # T5's decoder stack; BLOOM's blocks
                       if (n.startswith("decoder.") and n.endswith("layer.0.SelfAttention")) or n.endswith("self_attention")]
        self.times: list[float] = []

    def __enter__(self):
        def before(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            module._bench_start = time.perf_counter() if hidden is not None and hidden.shape[1] == 1 else None

        def after(module, args, kwargs, output):
            if module._bench_start is not None:
                self.times.append((time.perf_counter() - module._bench_start) * 1e6)

        self.handles = [h for m in self.layers for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                                          m.register_forward_hook(after, with_kwargs=True))]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def generation(families: list[str], inputs: list[int], new_tokens: int, rounds: int,
               dtype: torch.dtype = torch.float32) -> None:
    """Greedy ``generate`` of each family, unpatched, patched, and patched with attention free (the bound), the three
    interleaved for ``rounds`` rounds in this process (the best round of each as tokens/s, the ratios as the medians of
    each round's own); identical tokens checked."""
    print(f"{'model':>6} {'input':>6} {'unpatched tok/s':>16} {'patched tok/s':>14} {'bound tok/s':>12} "
          f"{'unpatched/patched':>18} {'unpatched/bound':>16} {'share of bound':>15}  same tokens")
    for family in families:
        plain, patched = (model.to(dtype) for model in _models(family))
        for n in inputs:
            vocabulary = 32000 if family == "t5" else 1024
            ids = torch.randint(2, vocabulary, (1, n), generator=torch.Generator().manual_seed(n))
            settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            attention_mask=torch.ones_like(ids))
            seconds, outs, layer_us = {}, {}, {}  # seconds: each variant's time in every round
            with torch.no_grad():
                for round_ in range(rounds + 1):  # the last round times the decoding steps' self-attention layers
                    for name, model in (("unpatched", plain), ("patched", patched), ("bound", patched)):
                        timed = _LayerTimes(model) if round_ == rounds else contextlib.nullcontext()
                        with _FreeAttention() if name == "bound" else contextlib.nullcontext(), timed:
                            start = time.perf_counter()
                            out = model.generate(ids, **settings)
                            elapsed = time.perf_counter() - start
                        if round_ == rounds:
                            layer_us[name] = statistics.median(timed.times)
                            continue
                        seconds.setdefault(name, []).append(elapsed)
                        if name != "bound":
                            outs[name] = out
            rate = {name: new_tokens / min(s) for name, s in seconds.items()}
            gain, most = (statistics.median(u / t for u, t in zip(seconds["unpatched"], seconds[name]))
                          for name in ("patched", "bound"))
            share = (gain - 1) / (most - 1) if most > 1 else float("nan")
            same = torch.equal(outs["unpatched"], outs["patched"])
            print(f"{family:>6} {n:>6} {rate['unpatched']:>16.1f} {rate['patched']:>14.1f} {rate['bound']:>12.1f} "
                  f"{gain:>17.2f}x {most:>15.2f}x {share:>15.2f}  {same}")
            print(f"{'':>13} one decoding step's self-attention layer (median us, projections included): unpatched "
                  f"{layer_us['unpatched']:.0f}, patched {layer_us['patched']:.0f}, bound {layer_us['bound']:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, nargs="+", default=[1], help="queries per call Lq (default 1)")
    parser.add_argument("--lengths", type=int, nargs="*", default=[128, 512, 2048, 8192],
                        help="cached keys Lk (none: no per-call table)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per method (median reported)")
    parser.add_argument("--loop", type=int, default=0, metavar="N",
                        help="also time N calls in a row per method, best of 7 runs (default 0: not)")
    parser.add_argument("--inputs", type=int, nargs="*", default=[512, 4096], help="input tokens for generate (default 512 4096; the flag alone: no generation, the kernel "
                             "table only)")
    parser.add_argument("--models", nargs="+", choices=("t5", "bloom"), default=["t5", "bloom"],
                        help="model families for generate (default both)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy new tokens per generate")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved generate rounds per model (tok/s: the best; ratios: the rounds' median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="queries, cache and models in this dtype (default float32)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"bench_decode: torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; load average "
          f"{os.getloadavg()}")
    if args.lengths:
        decode_steps(args.queries, args.lengths, args.calls, args.loop, dtype)
    if args.inputs:
        generation(args.models, args.inputs, args.new_tokens, args.rounds, dtype)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
