"""Triton kernel options for compiled FlexAttention on a GPU in half precision: block sizes and pipeline stages
that fit the device's shared memory.

Inductor picks one default configuration per (GPU generation, dtype, head_dim) and does not check it against the
device; with a ``score_mod`` that reads a captured table (the per-offset bias) its bfloat16 kernels were seen to
need more shared memory than an H200 has ("No valid triton configs ... Required: 311296, Hardware limit:
232448"). Here the largest candidate whose estimated footprint, times :data:`MARGIN`, fits
``shared_memory_per_block_optin`` is passed as ``kernel_options`` (``fwd_*`` and, with gradients, ``bwd_*``), and
a compile that still runs out of shared memory is retried once at candidates :func:`shrink` picks from the
requirement the error reports (:func:`retry_factor`).

The estimate counts the tiles a kernel keeps in shared memory: the forward's query tile and ``num_stages``
buffered key and value tiles, plus a float32 score tile for layout conversion; the backward's resident
(key, value) or (query, grad-out) tiles, ``num_stages`` buffered tiles of the other pair and two float32 tiles
(scores and their gradient). Triton's real footprint adds layout buffers this does not model: the margin covers
them. The error above did not say which kernel failed; were it inductor's H100 bfloat16 forward default (128 x 128,
3 stages, head_dim 64), its requirement was 1.7x this count, and the margin keeps the choice below that default.
Block sizes divide FlexAttention's 128-token sparse block, as its kernels require.
"""

from __future__ import annotations

import re

import torch

__all__ = ["FORWARD", "BACKWARD", "MARGIN", "choose", "for_call", "shrink", "retry_factor", "forward_bytes",
           "backward_bytes", "shared_memory"]

#: Forward candidates (BLOCK_M, BLOCK_N, num_stages, num_warps), largest first.
FORWARD = ((128, 128, 3, 4), (128, 64, 3, 4), (64, 64, 3, 4), (64, 64, 2, 4), (64, 32, 2, 4), (32, 32, 1, 4),
           (16, 16, 1, 4))
#: Backward candidates (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps), largest first.
BACKWARD = ((64, 128, 128, 64, 3, 8), (64, 64, 64, 64, 3, 4), (32, 64, 64, 32, 2, 4), (32, 32, 32, 32, 1, 4),
            (16, 16, 16, 16, 1, 4))
#: Estimated bytes times this must fit the device's shared memory per block.
MARGIN = 2.0


def forward_bytes(block_m: int, block_n: int, stages: int, itemsize: int, head_dim: int, value_dim: int) -> int:
    """Estimated shared memory (bytes) of the forward kernel: the query tile, ``stages`` key and value tiles and a
    float32 (BLOCK_M, BLOCK_N) score tile."""
    return itemsize * (block_m * head_dim + stages * block_n * (head_dim + value_dim)) + 4 * block_m * block_n


def backward_bytes(block_m1: int, block_n1: int, block_m2: int, block_n2: int, stages: int, itemsize: int,
                   head_dim: int, value_dim: int) -> int:
    """Estimated shared memory (bytes) of the backward kernel, the larger of its two halves: dk/dv (key and value
    tiles resident, ``stages`` query and grad-out tiles) and dq (query and grad-out resident, ``stages`` key and
    value tiles), each with two float32 score-sized tiles."""
    pair = head_dim + value_dim
    dkdv = itemsize * (block_n1 * pair + stages * block_m1 * pair) + 8 * block_m1 * block_n1
    dq = itemsize * (block_m2 * pair + stages * block_n2 * pair) + 8 * block_m2 * block_n2
    return max(dkdv, dq)


def choose(shared_memory: int, dtype: torch.dtype, head_dim: int, value_dim: int, backward: bool,
           factor: float = 1.0) -> dict:
    """The ``kernel_options`` for a device with ``shared_memory`` bytes per block.

    Args:
        shared_memory: the device's ``shared_memory_per_block_optin`` (bytes).
        dtype: the inputs' dtype (its item size enters the estimate).
        head_dim, value_dim: query/key and value head dims.
        backward: also choose the backward's options (``bwd_*``).
        factor: extra factor on the estimate (> 1 on a retry, from :func:`retry_factor`; values below 1 count as 1).

    Returns:
        ``fwd_BLOCK_M``, ``fwd_BLOCK_N``, ``fwd_num_stages``, ``fwd_num_warps`` and, with ``backward``, the
        ``bwd_`` block sizes, stages and warps: the first candidate of :data:`FORWARD` / :data:`BACKWARD` whose
        estimate times :data:`MARGIN` and ``factor`` fits, else the smallest.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = shared_memory / (MARGIN * max(1.0, factor))
    fwd = next((c for c in FORWARD if forward_bytes(*c[:3], itemsize, head_dim, value_dim) <= budget), FORWARD[-1])
    options = dict(zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), fwd))
    if backward:
        bwd = next((c for c in BACKWARD if backward_bytes(*c[:5], itemsize, head_dim, value_dim) <= budget),
                   BACKWARD[-1])
        names = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages", "bwd_num_warps")
        options.update(zip(names, bwd))
    return options


def retry_factor(error: BaseException) -> float | None:
    """How much smaller a retry's footprint must be, from a compile error; None when the error is not inductor's
    "No valid triton configs" or Triton's out-of-resource error. The factor is the largest reported requirement over
    the limit ("Required: 311296 ... Hardware limit: 232448"), at least 2 and at most 1e6."""
    text = str(error)
    if "No valid triton configs" not in text and "out of resource" not in text:
        return None
    required = [float(n) for n in re.findall(r"Required:\s*(\d+)", text)]
    limit = [float(n) for n in re.findall(r"Hardware limit:\s*(\d+)", text)]
    if required and limit and min(limit) > 0:
        return min(1e6, max(2.0, max(required) / min(limit)))
    return 2.0


def shrink(options: dict, shared_memory: int, dtype: torch.dtype, head_dim: int, value_dim: int,
           factor: float) -> dict:
    """The options of a retry: :func:`choose` with the estimate times ``factor``, and never a candidate larger
    than ``options``' (the smallest candidates when nothing smaller is left)."""
    backward = "bwd_BLOCK_M1" in options
    smaller = choose(shared_memory, dtype, head_dim, value_dim, backward, factor)
    for prefix, candidates in (("fwd_", FORWARD), ("bwd_", BACKWARD)):
        keys = [k for k in smaller if k.startswith(prefix)]
        if not keys:
            continue
        index = {c: n for n, c in enumerate(candidates)}
        now = index[tuple(smaller[k] for k in keys)]
        was = index.get(tuple(options.get(k) for k in keys), -1)  # options of no candidate: any is smaller
        if now <= was:
            smaller.update(zip(keys, candidates[min(was + 1, len(candidates) - 1)]))
    return smaller


def for_call(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int,
             backward: bool) -> tuple[int, dict] | None:
    """(the device's shared memory per block, :func:`choose`'s options) for a bfloat16 or float16 call on a GPU; None
    for other dtypes and devices, where inductor's defaults stay."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    memory = shared_memory(device)
    if memory is None:
        return None
    return memory, choose(memory, dtype, head_dim, value_dim, backward)


def shared_memory(device: torch.device) -> int | None:
    """Shared memory per block (bytes) a kernel may opt into on a CUDA device; None on other devices."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    memory = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    return int(memory) or None
