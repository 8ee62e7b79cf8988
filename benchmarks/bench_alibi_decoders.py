"""Benchmark: BLOOM, MPT and Falcon (``alibi=True``) prefill and per-token decoding, unpatched vs patched with
relbias (``relbias.integrations.transformers.patch``).

Models, built from configs with random weights (seed 0), ``--layers`` layers each (the attention's share of a
layer does not depend on how many there are), vocabulary 1024, float32, CPU:

* bloom: bloom-560m's layer (hidden 1024, 16 heads);
* mpt: hidden 1024, 16 heads, ``max_seq_len`` the longest length run;
* falcon: falcon-rw-1b's layer (hidden 2048, 32 heads, ``alibi=True``, sdpa).

Prefill: one forward of the base model over ``L`` tokens of batch 1 with ``use_cache=True`` (what ``generate``
runs first). Decode: after a ``--prompt``-token prefill into a ``DynamicCache``, ``--new`` greedy steps of one
token each (the causal LM's forward with the cache and the growing attention mask, as ``generate`` runs them;
transformers' MPT ``generate`` keeps no cache, so the steps are driven here for every model): seconds per token
are the steps' time over ``--new``; peak memory covers the prefill and the steps.

Method. Every (model, measurement, variant) runs in a fresh Python process: after the model and inputs exist,
garbage is collected, one untimed call warms up, the peak-RSS counter is reset, then the timed call runs; *peak
MiB* is the resident set's peak during it above the resident set before it (``benchmarks/_proc.py``). Each variant
runs ``--rounds`` times, alternating, the faster round reported. Ratios are unpatched / patched. Prints the load
average before and after; run it on an otherwise idle machine.

    python benchmarks/bench_alibi_decoders.py                       # 512, 2048, 4096 tokens; decode after 512
    python benchmarks/bench_alibi_decoders.py --models bloom --lengths 4096 --rounds 2
    python benchmarks/bench_alibi_decoders.py --models falcon --lengths 4096 --bound   # the ceiling of any gain
    python benchmarks/bench_alibi_decoders.py --lengths 512 2048 --compiled   # prefill under torch.compile too
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from _proc import reset_peak, status_kib

MODELS = ("bloom", "mpt", "falcon")


def build(name: str, layers: int, max_len: int):
    """The causal LM ``name`` with random weights (seed 0), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "bloom":
        config = transformers.BloomConfig(vocab_size=1024, hidden_size=1024, n_layer=layers, n_head=16)
        return transformers.BloomForCausalLM(config).eval()
    if name == "mpt":
        config = transformers.MptConfig(vocab_size=1024, d_model=1024, n_layers=layers, n_heads=16,
                                        max_seq_len=max_len)
        return transformers.MptForCausalLM(config).eval()
    config = transformers.FalconConfig(vocab_size=1024, hidden_size=2048, num_hidden_layers=layers,
                                       num_attention_heads=32, alibi=True, multi_query=False, parallel_attn=False,
                                       new_decoder_architecture=False, bias=True)
    return transformers.FalconForCausalLM(config).eval()


def run_child(args: argparse.Namespace) -> dict:
    """One (model, measurement, variant) in this process."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.model, args.layers, args.max_len)
    if args.variant in ("patched", "no-attention", "patched-compiled"):
        from relbias.integrations.transformers import patch

        patch(model)
    if args.variant == "no-attention":  # the patched layers' attention call returns its query: attention costs 0
        from relbias.integrations import alibi_common

        alibi_common.attention = lambda query, key, value, **kwargs: query
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (1, args.length if args.what == "prefill" else args.prompt), generator=generator)

    base = model.base_model
    if args.variant.endswith("-compiled"):  # prefill only: inductor, static shapes; the warm-up call compiles
        base = torch.compile(base, dynamic=False)

    def prefill():
        base(input_ids=ids, use_cache=True)

    def decode():  # greedy steps on a DynamicCache, one token each; returns their seconds
        cache, mask = DynamicCache(config=model.config), torch.ones_like(ids)
        token = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(args.new):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            token = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True).logits.argmax(-1)
        return time.perf_counter() - start

    call = prefill if args.what == "prefill" else decode
    with torch.no_grad():
        call()  # warm-up (kernels built, caches allocated)
        gc.collect()
        reset_peak()
        before = status_kib("VmRSS")
        start = time.perf_counter()
        stepped = call()
        seconds = time.perf_counter() - start
        peak = (status_kib("VmHWM") - before) / 1024
    if args.what == "decode":
        seconds = stepped / args.new
    return {"seconds": seconds, "peak_mib": peak, "threads": torch.get_num_threads(),
            "isa": torch.backends.cpu.get_cpu_capability()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 4096],
                        help="prefill tokens (none: decode only)")
    parser.add_argument("--prompt", type=int, default=512, help="decode: prompt tokens (default 512)")
    parser.add_argument("--new", type=int, default=32, help="decode: tokens generated (default 32)")
    parser.add_argument("--layers", type=int, default=2, help="layers per model (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--bound", action="store_true",
                        help="prefill: also time the patched model with attention costing nothing (its call returns "
                             "the query): unpatched / that is the most any attention kernel could gain")
    parser.add_argument("--compiled", action="store_true",
                        help="prefill: also time both models' base model under torch.compile (inductor, static "
                             "shapes; the untimed warm-up call compiles)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bloom", help=argparse.SUPPRESS)
    parser.add_argument("--what", default="prefill", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="patched", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, default=4096, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"ALiBi decoders, {args.layers} layers, batch 1, float32, CPU; load average before: {load}")
    max_len = max([*args.lengths, args.prompt + args.new])
    runs = [("prefill", length) for length in args.lengths] + [("decode", args.prompt)]
    for model in args.models:
        for what, length in runs:
            best = {}
            variants = ["unpatched", "patched"] + (["no-attention"] if args.bound and what == "prefill" else [])
            if args.compiled and what == "prefill":
                variants += ["unpatched-compiled", "patched-compiled"]
            for variant in variants * args.rounds:
                command = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--what", what,
                           "--variant", variant, "--length", str(length), "--prompt", str(args.prompt), "--new",
                           str(args.new), "--layers", str(args.layers), "--threads", str(args.threads),
                           "--max-len", str(max_len)]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"  {model} {what} {length} {variant} failed (exit {done.returncode}): "
                          f"{done.stderr.strip()[-400:]}")
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if variant not in best or result["seconds"] < best[variant]["seconds"]:
                    best[variant] = result
            label = f"{model:6s} {what} L={length}" + (f" (+{args.new} tokens)" if what == "decode" else "")
            for variant, r in best.items():
                unit = "ms/token" if what == "decode" else "ms"
                print(f"  {label:32s} {variant:18s} {r['seconds'] * 1e3:9.1f} {unit:8s} peak {r['peak_mib']:8.1f} MiB"
                      f"  threads {r['threads']}  {r['isa']}")
            if "no-attention" in best and "unpatched" in best:
                bound = best["unpatched"]["seconds"] / best["no-attention"]["seconds"]
                print(f"  {label:32s} bound        {bound:5.2f}x (unpatched / no-attention: the most any attention "
                      f"could gain)")
            for suffix in ("", "-compiled"):
                if f"unpatched{suffix}" in best and f"patched{suffix}" in best:
                    plain, patched = best[f"unpatched{suffix}"], best[f"patched{suffix}"]
                    memory = (f"{plain['peak_mib'] / patched['peak_mib']:5.2f}x less peak memory"
                              if min(plain["peak_mib"], patched["peak_mib"]) >= 1 else "peak memory under 1 MiB")
                    print(f"  {label:32s} {'ratio' + suffix:18s} {plain['seconds'] / patched['seconds']:5.2f}x faster, "
                          f"{memory} (unpatched{suffix} / patched{suffix})")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
