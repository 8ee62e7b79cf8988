"""Whether the Triton kernels can run here: triton installed, a CUDA device or the Triton interpreter, a dtype and
head dims they take; and the one-time check of the compiled kernels against the reference on each CUDA device."""

from __future__ import annotations

import functools
import importlib.util
import copy
import math

import torch

__all__ = ["MAX_HEAD_DIM", "device_reason", "interpreted", "kernel_check", "triton_missing_reason"]

#: Largest head_dim (and value head_dim) the kernels tile: one tile row holds a whole head.
MAX_HEAD_DIM = 256

#: (device index, dtype, head_dim, value head_dim) -> None (the compiled kernels agree with the reference) or why not.
_CHECKED: dict[tuple, str | None] = {}


@functools.lru_cache(maxsize=1)
def triton_missing_reason() -> str | None:
    """Why the kernels cannot be built at all (triton absent), else None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'relbias[triton]')"
    return None


def interpreted() -> bool:
    """Whether the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, read when triton decorates
    them: on CPU tensors, slowly, for testing)."""
    from . import _forward  # decorated on import: their mode is fixed then

    return type(_forward._forward_kernel).__name__ == "InterpretedFunction"


def device_reason(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int) -> str | None:
    """Why the kernels cannot take tensors of ``dtype`` on ``device`` with these head dims; None when they can."""
    missing = triton_missing_reason()
    if missing:
        return missing
    if device.type == "cpu":
        if not interpreted():
            return ("the Triton kernels run on CUDA devices, or on CPU tensors only under the Triton interpreter "
                    "(set TRITON_INTERPRET=1 before relbias loads them)")
        if dtype not in (torch.float32, torch.float16):
            return f"the Triton interpreter takes float32 and float16 here, not {dtype} (it has no bfloat16)"
    elif device.type != "cuda":
        return f"the Triton kernels run on CUDA devices, not {device.type}"
    elif dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the Triton kernels take float32, float16 and bfloat16, not {dtype}"
    if max(head_dim, value_dim) > MAX_HEAD_DIM:
        return f"head_dim {head_dim} / value head_dim {value_dim} above {MAX_HEAD_DIM}: one tile row holds a head"
    if device.type == "cuda" and interpreted():
        return "the Triton kernels were loaded under TRITON_INTERPRET=1, which runs on CPU tensors only"
    return None


def kernel_check(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int) -> str | None:
    """Compare the compiled kernels with the reference once per (CUDA device, dtype, head_dim, value head_dim):
    a T5 bias, causal and bidirectional with a key padding mask, at (2, 3, 80) (two tiles), output and every
    gradient (query, key, value, bias table). Tolerance: FlashAttention's rule, twice the error of the same
    computation in PyTorch in this dtype, plus 1e-5 of the reference's largest magnitude. None when they agree;
    otherwise the reason (the error found, or the compiler's exception), which makes the backend refuse its calls."""

    key = (device.index, dtype, head_dim, value_dim)
    if key not in _CHECKED:
        try:  # the first call may come under torch.no_grad() or inference_mode(): the check differentiates
            with torch.inference_mode(False), torch.enable_grad():
                _CHECKED[key] = _compare(device, dtype, head_dim, value_dim)
        except Exception as error:  # the kernels do not compile or launch here
            _CHECKED[key] = (f"the Triton kernels failed on {_device_name(device)} ({dtype}, head_dim {head_dim}): "
                             f"{type(error).__name__}: {str(error).strip()[:300]}")
    return _CHECKED[key]


#: :func:`kernel_check` and :func:`device_reason` as torch.compile sees them: run when the graph is traced, their
#: verdicts constants of the graph (dynamo would otherwise trace the check's own kernels and comparisons).
traced_kernel_check = torch.compiler.assume_constant_result(kernel_check)
traced_device_reason = torch.compiler.assume_constant_result(device_reason)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _compare(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int) -> str | None:
    """The comparison of :func:`kernel_check` (the kernels run directly, not through the dispatcher that asks for
    this check); None when they agree, else what disagrees."""
    from ...backends.reference import reference_attention
    from ...biases.t5 import T5Bias
    from ...call import make_call
    from . import triton_attention

    generator = torch.Generator().manual_seed(0)
    for is_causal in (False, True):
        bias = T5Bias(3, bidirectional=not is_causal)
        with torch.no_grad():
            bias.weight.copy_(torch.randn(bias.weight.shape, generator=generator))
        tensors = [torch.randn(2, 3, 80, n, generator=generator) for n in (head_dim, head_dim, value_dim)]
        padding = torch.rand(2, 1, 1, 80, generator=generator) > 0.2
        grad = torch.randn(2, 3, 80, value_dim, generator=generator)
        results = {}
        for name, where, kind in (("exact", "cpu", torch.float64), ("torch", device, dtype), ("triton", device, dtype)):
            inputs = [t.to(where, kind).requires_grad_() for t in tensors]
            table = copy.deepcopy(bias).to(where, kind)
            call = make_call(*inputs, bias=table, mask=padding.to(where), is_causal=is_causal)
            out = (triton_attention if name == "triton" else reference_attention)(call)[0]
            grads = torch.autograd.grad(out, [*inputs, table.weight], grad.to(where, kind))
            results[name] = [t.double().cpu() for t in (out, *grads)]
        for what, want, base, got in zip(("out", "dq", "dk", "dv", "dbias"), *results.values()):
            allowed = 2 * (base - want).abs().max().item() + 1e-5 * want.abs().max().item()
            error = (got - want).abs().max().item()
            if not math.isfinite(error) or error > allowed:
                return (f"the Triton kernels disagree with the reference on {_device_name(device)} "
                        f"({dtype}, head_dim {head_dim}, {'causal' if is_causal else 'bidirectional'}): {what} error "
                        f"{error:.3g}, allowed {allowed:.3g}")
    return None
