"""The cases of the FSDP2 x context-parallel tests (not a test module): what the 4 gloo ranks train (a 2 x 2
("dp", "cp") mesh, through examples/fsdp_context_parallel.py's own functions) and what the test recomputes in one
process on the whole batch."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp_context_parallel.py"
DP, CP = 2, 2
SEQ_LEN, ROWS, STEPS = 64, 4, 5
# AdamW's eps: with torch's 1e-8, two single-process float32 runs that differ only in how the batch's gradient is
# summed (whole, or 4 accumulated micro-batches) already end 2.3e-5 apart after 5 steps of lr 3e-3: a weight whose
# gradient is a near-cancelling sum gets a normalised step m / sqrt(v) that its rounding decides. With 1e-6 the
# distributed T5 run still ended 1.6e-4 from the single-process one on an Intel Xeon (AVX-512) with torch's kernels
# at ATEN_CPU_CAPABILITY=default and relbias' built for x86-64-v2 (other combinations: within 1e-5); with 1e-5 the
# parameters of both T5 cases end within 1e-6 there, so the 1e-5 comparison measures the distributed bookkeeping, not
# Adam's amplified rounding (the naive composition still ends 2.2e-3 away, test_summing_bias_gradients_twice_is_caught).
ADAM_EPS = 1e-5


def recipe():
    """The example script as a module (it is not part of the package)."""
    spec = importlib.util.spec_from_file_location("fsdp_context_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "bytelm" or "t5"
    position: str = "t5"  # ByteLM's bias family
    reshard_after_forward: bool = True
    sync_bias_grads: bool = False  # True: the naive composition, bias gradients summed over "cp" and again by FSDP


CASES = [
    Case("bytelm-t5", "bytelm", "t5"),
    Case("bytelm-t5-no-reshard", "bytelm", "t5", reshard_after_forward=False),
    Case("bytelm-alibi", "bytelm", "alibi"),
    Case("bytelm-offset", "bytelm", "offset"),
    Case("t5", "t5"),
    Case("t5-no-reshard", "t5", reshard_after_forward=False),
    Case("bytelm-t5-naive", "bytelm", "t5", sync_bias_grads=True),
]
CHECKPOINTED = "bytelm-t5"  # saved with torch.distributed.checkpoint after its steps, then loaded back


def build(case: Case, mesh, fsdp_mesh, *, seed: int = 0):
    r = recipe()
    if case.kind == "t5":
        model = r.build_t5(mesh, fsdp_mesh, seed=seed, reshard_after_forward=case.reshard_after_forward)
    else:
        model = r.build_bytelm(r.bytelm_config(case.position, SEQ_LEN), mesh, fsdp_mesh, seed=seed,
                               reshard_after_forward=case.reshard_after_forward)
    if mesh is not None and case.sync_bias_grads:
        for module in model.modules():
            if hasattr(module, "cp_sync_bias_grads"):
                module.cp_sync_bias_grads = True
    return model


def batches():
    """STEPS training batches and one more (the loss after the checkpoint)."""
    return recipe().text_batches(STEPS + 1, ROWS, SEQ_LEN)
