"""Benchmark: sentence-transformers ``encode`` with an MPNet model, unpatched vs patched with relbias (``patch``).

Model: an all-mpnet-base-v2-shaped ``SentenceTransformer`` (MPNet with hidden size 768, 12 layers, 12 heads,
intermediate 3072, 32 buckets; mean pooling; normalisation) built from a config with random weights (seed 0) and a
tokenizer built here (a small word vocabulary), saved to a temporary folder and loaded from it: no download.
Texts: ``--texts`` strings of ``L - 2`` vocabulary words each, so that every text is exactly ``L`` tokens with its
start and end tokens. ``encode(texts, batch_size=--batch)`` in float32 on CPU.

Method. Every (length, variant) runs in a fresh Python process (``--child``): after the model and the texts exist,
garbage is collected, the peak-RSS counter is reset, one ``encode`` of the first batch warms up, then the timed
``encode`` of all texts runs; *peak MiB* is the resident set's peak during it above the resident set before it
(``benchmarks/_proc.py``). Each variant runs ``--rounds`` times, alternating, the faster round reported. Ratios are
unpatched / patched (texts per second: patched / unpatched). Prints the load average before and after; run it on an
otherwise idle machine.

    python benchmarks/bench_mpnet.py                          # 32 texts at 128, 384 and 512 tokens, batch 32
    python benchmarks/bench_mpnet.py --texts 1000 --threads 2
    python benchmarks/bench_mpnet.py --variants unpatched patched unpatched-compiled patched-compiled

The ``-compiled`` variants run the MPNet encoder under ``torch.compile`` (inductor, static shapes); the warm-up
``encode`` compiles it, so the timed one runs compiled code.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from _proc import reset_peak, status_kib

WORDS = ("the a of to and in is was for on that with as by at from his it an were are which this be or has had not "
         "but what all when we there can one more if out so up said do into time them would other like than then").split()
VOCAB = ["<s>", "<pad>", "</s>", "[UNK]", "<mask>", *WORDS]


def _build(folder: str) -> None:
    """An all-mpnet-base-v2-shaped SentenceTransformer with random weights, saved to ``folder``."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    config = transformers.MPNetConfig(vocab_size=len(VOCAB), hidden_size=768, num_hidden_layers=12,
                                      num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514)
    torch.manual_seed(0)
    transformers.MPNetModel(config).save_pretrained(f"{folder}/mpnet")
    transformers.MPNetTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(f"{folder}/mpnet")
    modules = [Transformer(f"{folder}/mpnet", max_seq_length=512), Pooling(768, "mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(f"{folder}/st")


def run_child(args: argparse.Namespace) -> dict:
    """One (length, variant) in this process: load, warm up, then time and measure one encode of every text."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    model = SentenceTransformer(f"{args.folder}/st", device="cpu")
    if args.variant.startswith("patched"):
        from relbias.integrations.transformers import patch

        patch(model)
    if args.variant.endswith("-compiled"):  # the MPNet encoder under inductor, static shapes: the warm-up compiles
        encoder = model[0].auto_model
        encoder.forward = torch.compile(encoder.forward, dynamic=False)  # sentence-transformers calls .forward
    words = [WORDS[(i * 7 + j) % len(WORDS)] for i in range(args.texts) for j in range(args.length - 2)]
    texts = [" ".join(words[i * (args.length - 2):(i + 1) * (args.length - 2)]) for i in range(args.texts)]
    tokens = len(model.tokenizer(texts[0])["input_ids"])
    model.encode(texts[: args.batch], batch_size=args.batch)  # warm-up
    gc.collect()
    reset_peak()
    before = status_kib("VmRSS")
    start = time.perf_counter()
    model.encode(texts, batch_size=args.batch)
    seconds = time.perf_counter() - start
    return {"variant": args.variant, "length": args.length, "tokens": tokens, "seconds": seconds,
            "texts_per_s": args.texts / seconds, "peak_mib": (status_kib("VmHWM") - before) / 1024,
            "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 384, 512], help="tokens per text")
    parser.add_argument("--texts", type=int, default=32, help="texts encoded per run (default 32)")
    parser.add_argument("--batch", type=int, default=32, help="encode's batch_size (default 32)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs per variant, alternating; the faster is reported (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--variants", nargs="+", default=["unpatched", "patched"],
                        choices=["unpatched", "patched", "unpatched-compiled", "patched-compiled"],
                        help="the -compiled ones run the encoder under torch.compile (default unpatched patched)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="patched", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"sentence-transformers encode, all-mpnet-base-v2 shape (random weights), {args.texts} texts, batch "
          f"{args.batch}, float32, CPU; load average before: {load}")
    with tempfile.TemporaryDirectory() as folder:
        _build(folder)
        for length in args.lengths:
            best = {}
            for variant in args.variants * args.rounds:
                command = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant, "--length",
                           str(length), "--texts", str(args.texts), "--batch", str(args.batch), "--threads",
                           str(args.threads), "--folder", folder]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"  {variant} at {length} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if variant not in best or result["seconds"] < best[variant]["seconds"]:
                    best[variant] = result
            for variant, r in best.items():
                print(f"  L={r['tokens']:4d} {variant:18s} {r['texts_per_s']:7.1f} texts/s  ({r['seconds']:6.1f} s)  "
                      f"peak {r['peak_mib']:7.1f} MiB  threads {r['threads']}  {r['isa']}")
            for suffix in ("", "-compiled"):
                if f"unpatched{suffix}" in best and f"patched{suffix}" in best:
                    plain, patched = best[f"unpatched{suffix}"], best[f"patched{suffix}"]
                    print(f"  L={patched['tokens']:4d} ratio{suffix:9s} {plain['seconds'] / patched['seconds']:5.2f}x "
                          f"faster, {plain['peak_mib'] / max(patched['peak_mib'], 1e-9):5.2f}x less peak memory "
                          f"(unpatched{suffix} / patched{suffix})")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
