"""ALiBi, KERPLE and FIRE on every backend against the reference: output and gradients (all parameters).

tests/backends/test_equivalence.py covers every registered family at its defaults over many shapes and
masks; this file adds settings the defaults do not reach (FIRE with its threshold L inside the block, so
queries sit on both sides of it) in float64 as well as float32.
"""

import copy

import pytest
import torch

import relbias
from relbias import ALiBiBias, FIREBias, KerpleLogBias, KerplePowerBias
from relbias.backends import BACKENDS

from .._cpu import refused_here


def _check_backend_against_reference(backend, bias, is_causal):
    """Output and gradients of ``backend`` equal the reference's; float64 when the backend takes it, else
    float32; forward only when it refuses gradients; skipped with its reason when it refuses the call."""
    refusals = []
    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        for grad in (True, False):
            module = copy.deepcopy(bias).to(dtype)
            q, k, v = (torch.randn(2, bias.num_heads, 7, 4, dtype=dtype, requires_grad=grad) for _ in range(3))
            with torch.set_grad_enabled(grad):
                try:
                    got = relbias.attention(q, k, v, bias=module, is_causal=is_causal, backend=backend)
                except ValueError as exc:
                    if "cannot run this call" not in str(exc):
                        raise
                    refusals.append(str(exc))
                    continue
                expected = relbias.attention(q, k, v, bias=module, is_causal=is_causal, backend="reference")
            assert torch.allclose(got, expected, atol=atol)
            if grad:
                inputs = [q, k, v, *module.parameters()]
                weights = torch.randn_like(expected)
                mine = torch.autograd.grad((got * weights).sum(), inputs)
                theirs = torch.autograd.grad((expected * weights).sum(), inputs)
                for a, b in zip(mine, theirs):
                    assert torch.allclose(a, b, atol=atol * 10)
            return
    refused_here(backend, "; ".join(dict.fromkeys(refusals)), q)


CASES = {
    "alibi-causal": lambda: (ALiBiBias(4), True),
    "alibi-bidirectional": lambda: (ALiBiBias(4, bidirectional=True), False),
    "kerple_log-causal": lambda: (KerpleLogBias(3), True),
    "kerple_log-bidirectional": lambda: (KerpleLogBias(3, bidirectional=True), False),
    "kerple_power-causal": lambda: (KerplePowerBias(3), True),
    "kerple_power-bidirectional": lambda: (KerplePowerBias(3, bidirectional=True), False),
    # threshold 3.5 inside the block: queries on both sides of it
    "fire-causal": lambda: (FIREBias(3, init_threshold=3.5), True),
    "fire-bidirectional": lambda: (FIREBias(3, bidirectional=True, init_threshold=3.5), False),
}
#: compiling flex takes seconds per shape on CPU: two cases suffice here (test_equivalence runs all families)
FLEX_CASES = {"alibi-causal", "kerple_power-bidirectional"}


@pytest.mark.parametrize("backend", sorted(set(BACKENDS) - {"reference"}))
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_backend_matches_the_reference(backend, case):
    if backend == "flex" and case not in FLEX_CASES:
        pytest.skip("compiling flex takes seconds: checked on causal ALiBi and bidirectional KERPLE-power only")
    bias, is_causal = CASES[case]()
    _check_backend_against_reference(backend, bias, is_causal)
