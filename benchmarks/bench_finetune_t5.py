"""Benchmark: one fine-tuning step of a t5-small-shaped ``T5ForConditionalGeneration``, unpatched against patched
with relbias (``patch_t5``), on padded encoder batches, with and without attention dropout.

Model: from a config with t5-small's shape (d_model 512, 8 heads, d_kv 64, 6 + 6 layers, d_ff 2048, ReLU
feed-forward, 32 buckets, max_distance 128, vocab 32128), random weights (seed 0), float32, training mode, dropout
``--dropouts`` (T5's default is 0.1: attention probabilities and hidden states). The unpatched model runs
transformers' default attention ("sdpa"). Batch: ``--batch`` rows of random token ids whose encoder lengths are
spread evenly from L/2 to L tokens and right-padded to L (``attention_mask``: 1 = token), and ``--decoder-len``
random labels per row. One step = forward with ``labels`` (cross-entropy), backward, ``torch.optim.SGD.step``,
``zero_grad``.

Method. Every (length, dropout, variant) runs in fresh Python processes (``--child``), so that one configuration's
memory cannot hide in another's allocator pools: one process measures memory, then ``--rounds`` processes per
variant measure time, the variants' processes interleaved round by round (the first variant alternates) so that a
slow spell of the machine falls on both. Memory: after the imports (torch, transformers, relbias) the resident set
is read (``VmRSS``, the baseline); the model, optimizer and batch are built; the peak counter is reset; one step
runs; *peak memory* = the peak resident set (``VmHWM``) above the baseline, MiB: parameters, gradients, batch and
everything the step adds. That process fixes glibc's mmap threshold at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so
that freed tensors leave the resident set; the timing processes keep glibc's default, as a user's do (with the
fixed threshold every large allocation faults its pages in anew: the same step measured 1.3-1.8x slower). Time:
``--warmup`` untimed steps, then the median wall-clock time of ``--steps`` timed steps, s, and its process CPU
time. Printed per (length, dropout): the median over rounds for each variant, patched / unpatched for time and for
memory, the backend relbias picks for the encoder's self-attention (``relbias.explain_backend``) and the load
average before and after. Linux only (``/proc``).

Usage::

    python benchmarks/bench_finetune_t5.py                       # lengths 512 1024 2048, dropout 0.1 and 0
    python benchmarks/bench_finetune_t5.py --lengths 512 --rounds 1 --steps 1   # smoke run
    python benchmarks/bench_finetune_t5.py --variants unpatched-compiled patched-compiled   # under torch.compile

``--variants`` picks the models (the first is the baseline of the ratios): ``unpatched``, ``patched``, and the same
under ``torch.compile`` (inductor; the warm-up step, at least one, compiles). The backend column names what relbias
picks for the encoder's self-attention in eager code.

Targets: patched at most 0.95x unpatched time at 512 encoder tokens and at most 0.6x at 2048, with and without
dropout; peak memory at most 0.5x at 2048.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from _proc import reset_peak, status_kib

VARIANTS = ("unpatched", "patched", "unpatched-compiled", "patched-compiled")


def encoder_batch(batch: int, length: int, decoder_len: int, vocab: int):
    """(input_ids (batch, length) int64, attention_mask (batch, length) int64, labels (batch, decoder_len) int64):
    row r keeps its first length/2 + r (length/2) / (batch - 1) tokens (rounded), id 0 (T5's pad) after them."""
    import torch

    gen = torch.Generator().manual_seed(1)
    half = length // 2
    kept = torch.tensor([half + round(r * (length - half) / max(batch - 1, 1)) for r in range(batch)])
    attention_mask = (torch.arange(length)[None, :] < kept[:, None]).long()
    input_ids = torch.randint(1, vocab, (batch, length), generator=gen) * attention_mask
    labels = torch.randint(1, vocab, (batch, decoder_len), generator=gen)
    return input_ids, attention_mask, labels


def run_child(spec: dict) -> dict:
    """One (length, dropout, variant) in this process: build, then (``spec["measure"]``) either the peak memory of
    one step or the times of ``warmup + steps`` steps (see the module)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    import relbias
    from relbias.integrations import t5_biases_from_model
    from relbias.integrations.transformers import patch_t5

    torch.set_num_threads(spec["threads"])
    baseline = status_kib("VmRSS")  # after imports; no model, no batch
    config = transformers.T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
        dropout_rate=spec["dropout"], decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()
    input_ids, attention_mask, labels = encoder_batch(spec["batch"], spec["length"], spec["decoder_len"],
                                                      config.vocab_size)
    backend = None
    if spec["variant"].startswith("patched"):
        patch_t5(model)
        q = torch.empty(spec["batch"], 8, spec["length"], 64)
        keep = attention_mask.bool()[:, None, None, :]  # the encoder's key padding mask, (B, 1, 1, L)
        backend = relbias.explain_backend(q, q, q, bias=t5_biases_from_model(model).encoder[0], mask=keep,
                                          dropout_p=spec["dropout"])[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if spec["variant"].endswith("-compiled") else model  # compiles in the first step

    def step() -> None:
        loss = forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    gc.collect()
    if spec["measure"] == "memory":
        peak_ok = reset_peak()
        step()
        peak = status_kib("VmHWM") if peak_ok else float("nan")
        return {"peak_mib": (peak - baseline) / 1024, "backend": backend}
    walls, cpus = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        if i >= spec["warmup"]:
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    return {"step_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "backend": backend,
            "threads": torch.get_num_threads()}


def _run(spec: dict) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    if spec["measure"] == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"  {spec['variant']} failed (exit {done.returncode}): {done.stderr.strip()[-600:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048],
                        help="encoder lengths L in tokens, rows padded from L/2 to L (default 512 1024 2048)")
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.1, 0.0],
                        help="the model's dropout_rate (default 0.1, T5's, and 0)")
    parser.add_argument("--batch", type=int, default=4, help="rows per batch (default 4)")
    parser.add_argument("--decoder-len", type=int, default=128, help="labels per row in tokens (default 128)")
    parser.add_argument("--rounds", type=int, default=2, help="timing processes per variant, interleaved (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per process (default 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["unpatched", "patched"],
                        help="models to time, the first the baseline of the ratios (default unpatched patched); "
                             "*-compiled: the model under torch.compile (inductor), compiled in the warm-up step")
    parser.add_argument("--json", help="also write every process's figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return

    import torch
    import transformers

    print(f"bench_finetune_t5: t5-small shape, batch {args.batch} (encoder rows L/2..L padded to L, "
          f"{args.decoder_len} labels), SGD step, float32, {args.threads} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; load average before {_load()}", flush=True)
    variants = list(dict.fromkeys(args.variants))
    first = variants[0]
    print(f"{'L':>5} {'dropout':>7} " + " ".join(f"{v + ' s':>20} {'x ' + first:>12}" for v in variants) + "  "
          + " ".join(f"{v + ' MiB':>22}" for v in variants) + "  backend", flush=True)
    records = []
    for length in args.lengths:
        for dropout in args.dropouts:
            base = dict(length=length, dropout=dropout, batch=args.batch, decoder_len=args.decoder_len,
                        warmup=max(args.warmup, 1), steps=args.steps, threads=args.threads)
            memory, runs = {}, {v: [] for v in variants}
            for variant in variants:
                got = _run({**base, "variant": variant, "measure": "memory"})
                if got is not None:
                    memory[variant] = got["peak_mib"]
                    records.append({**base, "variant": variant, "measure": "memory", **got})
            for r in range(args.rounds):
                for variant in (variants if r % 2 == 0 else variants[::-1]):
                    got = _run({**base, "variant": variant, "measure": "time"})
                    if got is not None:
                        runs[variant].append(got)
                        records.append({**base, "variant": variant, "measure": "time", "round": r, **got})
            if len(memory) < len(variants) or not all(runs.values()):
                continue
            times = {v: statistics.median(x["step_s"] for x in runs[v]) for v in variants}
            backend = next((runs[v][0]["backend"] for v in variants if runs[v][0]["backend"]), "-")
            print(f"{length:5d} {dropout:7.2f} " + " ".join(f"{times[v]:20.2f} {times[v] / times[first]:11.2f}x"
                                                          for v in variants)
                  + "  " + " ".join(f"{memory[v]:22.0f}" for v in variants) + f"  {backend}", flush=True)
    print(f"load average after {_load()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)


if __name__ == "__main__":
    main()
