"""Check every relbias backend on a GPU, in stages within a time budget: equivalence with the reference, then time
and memory against SDPA.

GPU time comes in short spells, so the check is staged and budgeted (``--budget``, default 240 s): stage 1 checks,
for a few shapes, each backend that can run the call (``relbias.explain_backend`` says which cannot and why) against
the float32 reference: float32, bfloat16 and float16, forward and backward (query, key, value and bias-table
gradients), causal and bidirectional, Lq != Lk with explicit positions, a padding mask, a window, packed sequences,
dropout (relbias' counter-based mask: every backend drops the reference's entries for one seed), and the triton
backend's bias-table gradient bit-identical across two runs. The half-precision bound is FlashAttention's rule:
error <= 2 x (error of the reference run in that dtype) + atol. Stage 2 times the triton backend, forward and
forward+backward in bfloat16 at 1024 to 16384 tokens (causal; bidirectional at 8192), against bias-free SDPA
(FlashAttention), SDPA with the bias materialised and FlexAttention with the bias captured as a per-offset vector
(``torch.cuda.max_memory_allocated``, MiB above the inputs; time in ms, median of a few CUDA-event-timed calls after
warm-up); stage 3 one t5-base-shaped fine-tuning step, patched against unpatched.

Every case runs under its own time limit (``--case-limit``, default 60 s: a ``TIMEOUT`` line, then the next case)
and only while the budget lasts (a ``skipped: budget`` line for each case it leaves). Every result line is printed
as it is measured and appended to ``gpu_check.txt`` under ``$OUT`` when that is set (or to ``--log PATH``), so a run
killed from outside still reports what it did.

Usage::

    python benchmarks/gpu_check.py                          # CUDA, 240 s
    python benchmarks/gpu_check.py --budget 420 --case-limit 90
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --budget 300   # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import relbias
import relbias.backends
import relbias.backends.flex
from relbias.biases import make_bias

#: Every registered backend but the oracle (from the registry), then "auto".
BACKENDS = (*[name for name in relbias.backends.BACKENDS if name != "reference"], "auto")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CaseTimeout(Exception):
    """A case ran past its time limit."""


def _is_timeout(exc: BaseException) -> bool:
    """A :class:`CaseTimeout`, or one the Triton interpreter wrapped in its own error."""
    return isinstance(exc, CaseTimeout) or "CaseTimeout" in repr(exc)


class Budget:
    """The run's time budget (seconds) and each case's limit: ``with budget.case():`` raises :class:`CaseTimeout`
    in the case after ``min(case_limit, time left)`` seconds (SIGALRM: the main thread, Unix; a limit is checked
    only when Python code runs, so a kernel in flight finishes first); ``budget.left() <= 0`` skips the rest."""

    def __init__(self, seconds: float, case_limit: float):
        self.end, self.case_limit = time.monotonic() + seconds, case_limit

    def left(self) -> float:
        return self.end - time.monotonic()

    @contextlib.contextmanager
    def case(self):
        limit = min(self.case_limit, self.left())
        if not hasattr(signal, "setitimer") or limit <= 0:  # no alarm here (Windows), or nothing left: no limit
            yield
            return

        def expire(signum, frame):
            raise CaseTimeout(f"past its {limit:.0f} s limit")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


class Log:
    """Each line printed as it is measured and appended to ``path`` (flushed per line) when one is given."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")


def _run(backend, q, k, v, bias, grad_out, **kw):
    """[out] without ``grad_out``, else [out, dq, dk, dv, d(each bias parameter)]: relbias.attention, or
    relbias.attention_varlen where ``kw`` holds ``cu_seqlens``."""
    function = relbias.attention_varlen if "cu_seqlens" in kw else relbias.attention
    if "dropout_seed" in kw:  # a fresh generator per run: every backend draws the same seed, so the same mask
        kw = dict(kw, generator=torch.Generator().manual_seed(kw["dropout_seed"]))
        del kw["dropout_seed"]
    q, k, v = (t.detach().clone().requires_grad_(grad_out is not None) for t in (q, k, v))
    if bias is not None:
        bias.zero_grad(set_to_none=True)
    if grad_out is None:
        with torch.no_grad():
            return [function(q, k, v, bias=bias, backend=backend, **kw).float()]
    out = function(q, k, v, bias=bias, backend=backend, **kw)
    (out.float() * grad_out).sum().backward()
    grads = [q.grad, k.grad, v.grad]
    if bias is not None:
        grads += [p.grad if p.grad is not None else torch.zeros_like(p) for p in bias.parameters()]
    return [out.detach().float()] + [g.float() for g in grads]


def _max_err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _cases(n: int) -> list[tuple]:
    """name, family, B, H, Lq, Lk, D, kwargs, padding mask?"""
    return [
        ("t5 bidi", "t5", 2, 4, n, n, 64, dict(is_causal=False), False),
        ("t5 causal", "t5", 2, 4, n, n, 64, dict(is_causal=True), False),
        ("t5 Lq<Lk pos", "t5", 1, 4, n // 2, n + 96, 64, dict(is_causal=True, query_start=n + 40), False),
        ("offset pad-mask", "offset", 2, 4, n, n, 64, dict(is_causal=False), True),
        ("alibi causal", "alibi", 1, 4, n, n, 64, dict(is_causal=True), False),
        ("t5 window pad", "t5", 2, 4, n, n, 64, dict(is_causal=False, window=(n // 8, n // 16)), True),
        ("t5 causal win", "t5", 1, 4, n, n, 64, dict(is_causal=True, window=(n // 4 + 3, 0)), False),
        ("t5 packed", "t5", 1, 4, n, n, 64, dict(is_causal=True, cu_seqlens=[0, n // 4, n // 4, n - 37, n]), False),
        ("t5 dropout pad", "t5", 2, 4, n, n, 64, dict(is_causal=True, dropout_p=0.2, dropout_seed=5), True),
    ]


def _verdict(backend, q, k, v, bias, grad_out, kw, exact, plain) -> str:
    """One backend on one case: ``dtype[+bwd]: ok|FAIL err<=bound`` (or n/a with the refusal) per dtype and mode."""
    verdicts = []
    for dtype in DTYPES:
        qq, kk, vv = q.to(dtype), k.to(dtype), v.to(dtype)
        for with_grad in (False, True):
            label = f"{str(dtype)[6:]}{'+bwd' if with_grad else ''}"
            try:
                got = _run(backend, qq, kk, vv, bias, grad_out if with_grad else None, **kw)
            except Exception as exc:  # a refusal is n/a; anything else failed (a kernel that does not
                if _is_timeout(exc):  # compile or launch here): its traceback, then FAIL
                    raise CaseTimeout(str(exc)) from exc
                refused = "cannot run" in str(exc)
                if not refused:
                    traceback.print_exc()
                verdicts.append(f"{label}: {'n/a' if refused else 'FAIL'} ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:70]})")
                continue
            ref = exact if with_grad else exact[:1]
            err = _max_err(got, ref)
            scale = max(1.0, max(float(r.abs().max()) for r in ref))
            if dtype == torch.float32:
                bound = 1e-4 * scale
            else:  # FlashAttention's rule: twice the reference's own error in that dtype, plus a small atol
                rounded = plain[dtype] if with_grad else plain[dtype][:1]
                bound = 2 * _max_err(rounded, ref) + 1e-3 * scale
            verdicts.append(f"{label}: {'ok' if err <= bound else 'FAIL'} {err:.1e}<={bound:.1e}")
    return "; ".join(verdicts)


def equivalence(device: torch.device, small: bool, backends, budget: Budget):
    """Yields (case, backend, verdict) rows as they are measured, each (case, backend) under the case limit."""
    n = 64 if small else 512
    for name, family, b, h, lq, lk, d, kw, with_mask in _cases(n):
        if budget.left() <= 0:
            yield name, "-", "skipped: budget"
            continue
        try:
            with budget.case():
                bias = make_bias(family, num_heads=h, max_len=max(lq, lk) + 200,
                                 bidirectional=not kw["is_causal"]).to(device)
                with torch.no_grad():
                    for p in bias.parameters():
                        p.add_(0.3 * torch.randn_like(p))
                q, k, v = (torch.randn(b, h, length, d, device=device) for length in (lq, lk, lk))
                if with_mask:
                    mask = torch.ones(b, 1, 1, lk, dtype=torch.bool, device=device)
                    mask[0, ..., lk - lk // 4:] = False
                    kw = dict(kw, mask=mask)
                grad_out = torch.randn(b, h, lq, d, device=device)
                exact = _run("reference", q, k, v, bias, grad_out, **kw)
                plain = {dtype: _run("reference", q.to(dtype), k.to(dtype), v.to(dtype), bias, grad_out, **kw)
                         for dtype in DTYPES[1:]}
        except CaseTimeout as exc:
            yield name, "reference", f"TIMEOUT ({exc})"
            continue
        for backend in backends:
            if budget.left() <= 0:
                yield name, backend, "skipped: budget"
                continue
            try:
                with budget.case():
                    verdict = _verdict(backend, q, k, v, bias, grad_out, kw, exact, plain)
                    if backend == "triton" and name == "t5 causal" and "float32+bwd: ok" in verdict:
                        again = _run(backend, q, k, v, bias, grad_out, **kw)[4:]
                        first = _run(backend, q, k, v, bias, grad_out, **kw)[4:]
                        same = all(torch.equal(x, y) for x, y in zip(first, again))
                        verdict += f"; bias-table gradient bit-identical in two runs: {'ok' if same else 'FAIL'}"
            except Exception as exc:  # past the limit, or the determinism runs failed: say which
                if not _is_timeout(exc):
                    traceback.print_exc()
                verdict = (f"TIMEOUT ({exc})" if _is_timeout(exc) else
                           f"FAIL ({type(exc).__name__}: {str(exc).splitlines()[0][:70]})")
            yield name, backend, verdict


def _timed(fn, device, repeats=5):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _flex_captured(bias, n: int, causal: bool, device: torch.device, dtype: torch.dtype, grad: bool):
    """FlexAttention with the T5 bias captured as a per-offset vector (its (H, 2n - 1) native values) in score_mod,
    compiled once per shape; the bias-table gradient flows through the captured vector. In half precision with the
    block sizes the flex backend chooses for the device's shared memory (inductor's defaults can exceed it)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from relbias.backends.flex import _options

    compiled = torch.compile(flex_attention, dynamic=False)
    found = _options.for_call(device, dtype, 64, 64, backward=grad)
    kernel_options = None if found is None else found[1]
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n, device=device)

    def run(q, k, v):
        values = bias.native(n, n, query_start=0).values  # (H, 2n - 1): offset i - j at column i - j + n - 1

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + values[h, q_idx - kv_idx + n - 1].to(score.dtype)

        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, kernel_options=kernel_options)

    return run


def performance(device: torch.device, small: bool, dtype: torch.dtype, budget: Budget, flex: bool = True):
    """Yields lines as they are measured: N, mask, mode, method, ms, x sdpa, extra MiB, x sdpa. T5 bias (B=1, H=8,
    D=64, unscaled scores): bias-free SDPA (the 1.00x baseline: FlashAttention on CUDA), SDPA with the bias
    materialised as its float mask, the triton backend, FlexAttention with the bias captured per offset (at 8192
    tokens only, and with ``flex``: it compiles per shape). Each method under the case limit, while the budget
    lasts."""
    cases = [(n, True) for n in ((64,) if small else (1024, 2048, 4096, 8192, 16384))]
    cases += [(64 if small else 8192, False)]
    for n, causal in cases:
        for mode in ("fwd", "fwdbwd"):
            bias = relbias.T5Bias(8, bidirectional=not causal).to(device)
            grad = mode == "fwdbwd"
            q, k, v = (torch.randn(1, 8, n, 64, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
            captured = None
            if flex and device.type == "cuda" and n == 8192:
                captured = _flex_captured(bias, n, causal, device, dtype, grad)

            def step(method):
                with torch.set_grad_enabled(grad):
                    if method == "sdpa":
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
                    elif method == "sdpa_bias":
                        pe = bias(n, n).to(dtype)
                        if causal:
                            future = ~torch.ones(n, n, dtype=torch.bool, device=device).tril()
                            pe = pe.masked_fill(future, float("-inf"))
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pe, scale=1.0)
                    elif method == "flex_captured":
                        out = captured(q, k, v)
                    else:
                        out = relbias.attention(q, k, v, bias=bias, is_causal=causal, backend=method)
                    if grad:
                        out.float().sum().backward()

            base = None
            methods = ["sdpa", "sdpa_bias", "triton"] + (["flex_captured"] if captured is not None else [])
            for method in methods:
                where = f"{n:>5} {'causal' if causal else 'bidi':>6} {mode:>6} {method:>13}"
                if budget.left() <= 0:
                    yield f"{where}  skipped: budget"
                    continue
                line = None
                try:
                    with budget.case():
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            before = torch.cuda.memory_allocated()
                        step(method)
                        mem = float("nan")
                        if device.type == "cuda":
                            mem = (torch.cuda.max_memory_allocated() - before) / 2**20
                        ms = _timed(lambda: step(method), device)
                except Exception as exc:  # a method that cannot run here (out of memory, a refusal): say so
                    line = (f"{where}  TIMEOUT ({exc})" if _is_timeout(exc) else
                            f"{where}  n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                finally:
                    for t in (q, k, v, *bias.parameters()):
                        t.grad = None
                if line is not None:
                    yield line
                    continue
                if base is None:
                    base = (ms, mem)
                yield (f"{where} {ms:9.2f} {ms / base[0]:6.2f}x "
                       f"{mem:9.1f} {mem / base[1] if base[1] == base[1] and base[1] > 0 else float('nan'):6.2f}x")


def finetune_step(device: torch.device, small: bool, budget: Budget):
    """Yields lines: one AdamW step of a t5-base-shaped T5ForConditionalGeneration (random weights, bfloat16 on
    CUDA), unpatched (transformers' SDPA path) against patched (``relbias.integrations.transformers.patch_t5``): ms
    (median of 5 after 2 warm-up steps) and peak MiB above the model and optimizer state; each variant under the
    case limit, while the budget lasts."""
    try:
        import transformers
        from relbias.integrations.transformers import patch_t5
    except ImportError as exc:
        yield f"n/a: {exc}"
        return
    batch, enc, dec = (2, 128, 32) if small else (8, 512, 128)
    layers, d_model, heads = (2, 128, 4) if small else (12, 768, 12)
    times = {}
    for variant in ("unpatched", "patched"):
        if budget.left() <= 0:
            yield f"  {variant:9s} skipped: budget"
            continue
        try:
            with budget.case():
                ms, mem = _finetune_variant(transformers, patch_t5, variant, device, small, batch, enc, dec, layers,
                                            d_model, heads)
        except CaseTimeout as exc:
            yield f"  {variant:9s} TIMEOUT ({exc})"
            continue
        times[variant] = ms
        yield f"  {variant:9s} {ms:9.1f} ms {mem:9.0f} MiB"
    if len(times) == 2:
        yield f"  patched / unpatched time: {times['patched'] / times['unpatched']:.2f}x"


def _finetune_variant(transformers, patch_t5, variant, device, small, batch, enc, dec, layers, d_model, heads):
    """(ms, MiB) of one fine-tuning step of one variant (:func:`finetune_step`)."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32128, d_model=d_model, d_kv=64, d_ff=4 * d_model,
                                   num_layers=layers, num_heads=heads, dropout_rate=0.1,
                                   decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).train()
    if variant == "patched":
        patch_t5(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32128, (batch, enc), device=device)
    labels = torch.randint(0, 32128, (batch, dec), device=device)

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    ms = _timed(step, device)
    mem = (torch.cuda.max_memory_allocated() - before) / 2**20 if device.type == "cuda" else float("nan")
    return ms, mem


def main(argv=None) -> int:
    """Run the stages within the budget, logging each line as it is measured; exit status 1 if an equivalence check
    failed (a timeout or a skip is reported, not failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (small smoke run)")
    parser.add_argument("--skip-perf", action="store_true", help="equivalence only (stage 1)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), metavar="NAME",
                        help=f"the backends to check against the reference (default: all of {', '.join(BACKENDS)}); "
                             "FlexAttention's captured-bias timing runs only when flex is among them")
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds for the whole run (default 240): what is left when they are spent is skipped")
    parser.add_argument("--case-limit", type=float, default=60.0,
                        help="seconds for one case (default 60): a case past it is reported as TIMEOUT")
    parser.add_argument("--log", default=None,
                        help="append every line to this file as it is measured (default: $OUT/gpu_check.txt when "
                             "OUT is set, else none)")
    args = parser.parse_args(argv)
    if args.budget <= 0 or args.case_limit <= 0:
        parser.error(f"--budget and --case-limit must be positive seconds, got {args.budget} and {args.case_limit}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    budget = Budget(args.budget, args.case_limit)
    log = Log(args.log or (os.path.join(os.environ["OUT"], "gpu_check.txt") if os.environ.get("OUT") else None))
    small = device.type != "cuda"
    if small:  # compiling FlexAttention per shape on CPU takes ~20 s each: check its semantics eagerly
        relbias.backends.flex.COMPILE = False
    warnings.simplefilter("ignore", UserWarning)
    torch.manual_seed(0)
    start = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"gpu_check: torch {torch.__version__} on {name}; budget {args.budget:.0f} s, {args.case_limit:.0f} s a case")
    q = torch.randn(1, 8, 4096, 64, device=device)
    for grad in (False, True):
        t5 = relbias.T5Bias(8, bidirectional=False).to(device)
        with torch.set_grad_enabled(grad):
            picked, why = relbias.explain_backend(q, q, q, bias=t5, is_causal=True)
        log(f"  auto picks {picked} for t5 4096 causal ({'training' if grad else 'inference'}): "
            f"{why.splitlines()[0][len(picked) + 2:][:100]}")
    log("\nstage 1: equivalence vs the float32 reference (fwd, fwd+bwd; float32, bfloat16, float16):")
    failed = False
    for case, backend, verdict in equivalence(device, small, args.backends, budget):
        failed |= "FAIL" in verdict
        log(f"  {case:16s} {backend:10s} {verdict}")
    log(f"  [{time.time() - start:.0f} s]")
    if not args.skip_perf:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        log(f"\nstage 2: time and peak memory vs bias-free SDPA ({str(dtype)[6:]}, B=1 H=8 D=64, T5 bias; ms median, "
            f"MiB above inputs):")
        log(f"{'N':>5} {'mask':>6} {'mode':>6} {'method':>13} {'ms':>9} {'x':>7} {'MiB':>9} {'x':>7}")
        for line in performance(device, small, dtype, budget, flex="flex" in args.backends):
            log(line)
        log(f"  [{time.time() - start:.0f} s]")
        log(f"\nstage 3: t5-base-shaped fine-tuning step "
            f"({'batch 8 x 512 / 128 tokens, bfloat16' if not small else 'tiny'}):")
        for line in finetune_step(device, small, budget):
            log(line)
    log(f"\ngpu_check: {'FAILED' if failed else 'no equivalence check failed'} in {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
