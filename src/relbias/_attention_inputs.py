"""Input validation shared by every entry point: clear errors instead of silent broadcasting or NaN."""

from __future__ import annotations

import math

import torch

from .biases.base import CONVENTIONS, RelativeBias
from .positions import Alignment, resolve_alignment


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Validate (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv): types, ranks, sizes, dtypes, devices."""
    tensor = torch.Tensor
    if isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor):  # valid inputs: checked
        qs, ks, vs = query.shape, key.shape, value.shape  # in a few reads (every call pays them); errors are named below
        if (len(qs) == len(ks) == len(vs) == 4 and query.is_floating_point() and query.dtype == key.dtype == value.dtype
                and query.device == key.device == value.device and qs[:2] == ks[:2] == vs[:2] and qs[3] == ks[3]
                and ks[2] == vs[2]):
            return
    _explain_qkv(query, key, value)


def _explain_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise the error that names what is wrong with query, key and value (:func:`check_qkv` found something)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, num_heads, seq_len, head_dim), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    (b, h, _, d), (bk, hk, lk, dk), (bv, hv, lv, _) = query.shape, key.shape, value.shape
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: query {b}, key {bk}, value {bv}")
    if not (h == hk == hv):
        grouped = hk == hv and hk > 0 and h % hk == 0
        hint = "; for grouped-query attention (key/value heads shared by groups of query heads) pass enable_gqa=True"
        raise ValueError(f"num_heads differ: query {h}, key {hk}, value {hv}" + (hint if grouped else ""))
    if d != dk:
        raise ValueError(f"head_dim differs: query {d}, key {dk}")
    if lk != lv:
        raise ValueError(f"key and value must have the same length, got key_len {lk} and value_len {lv}")


def check_broadcast(name: str, t: torch.Tensor, target: tuple[int, ...], legend: str) -> None:
    """Raise unless ``t`` broadcasts to ``target`` (every dim 1 or equal, right-aligned, rank <= len)."""
    if t.dim() > len(target) or any(s != 1 and s != n for s, n in zip(reversed(t.shape), reversed(target))):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} does not broadcast to {legend} = {target}; "
            f"each dimension must be 1 or equal to the target"
        )


def check_scale(scale: float | None) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


def resolve_convention(convention: str | None, bias: object, scale: float | None, head_dim: int) -> tuple[str, float]:
    """Pick the score convention and the scale; see docs/conventions.md.

    Without ``convention``: a bias module's own (``default_convention``); "additive" for a tensor bias, so that it
    means what SDPA's ``attn_mask`` means (logits added after scaling); "seed" otherwise (no bias: the two agree)."""
    if convention is None:
        if isinstance(bias, RelativeBias):
            convention = bias.default_convention
        else:
            convention = "additive" if isinstance(bias, torch.Tensor) else "seed"
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    check_scale(scale)
    if convention == "t5":
        if scale is not None and scale != 1.0:
            raise ValueError(
                f"convention 't5' uses unscaled scores (scale 1), got scale={scale}; use convention='seed' "
                f"or 'additive' to scale"
            )
        return convention, 1.0
    return convention, float(scale) if scale is not None else 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def check_bias(bias: object, query: torch.Tensor, target: tuple[int, ...]) -> list[tuple] | None:
    """A bias is None, a RelativeBias with H in {1, num_heads}, or a finite float tensor broadcastable to target.
    Returns a module's :meth:`~relbias.RelativeBias.state_stamp` (taken for the parameter check), else None."""
    if bias is None:
        return None
    if isinstance(bias, RelativeBias):
        if bias.num_heads != 1 and bias.num_heads != target[1]:  # not `in`: a compiled graph's sizes are symbols
            raise ValueError(
                f"the bias module has num_heads={bias.num_heads}, but query has {target[1]} heads "
                f"(a bias must have 1 head, shared, or one per head; query's layout is "
                f"(batch, num_heads, seq_len, head_dim), so transpose a (batch, seq_len, num_heads, "
                f"head_dim) tensor first)"
            )
        tensors = bias.state_tensors()
        device = bias._device(tensors)
        if device != query.device:
            raise ValueError(f"the bias module is on {device} but query is on {query.device}; move one of them")
        return check_finite_parameters(bias, tensors)
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a RelativeBias module, a tensor or None, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"a bias tensor must be floating point, got {bias.dtype}")
    if bias.device != query.device:
        raise ValueError(f"the bias tensor is on {bias.device} but query is on {query.device}")
    check_broadcast("bias", bias, target, "(batch, num_heads, query_len, key_len)")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(bias).all()):  # a value check: eager only
        raise ValueError("the bias tensor contains NaN or inf; pass -inf masking through mask=, not bias=")
    return None


def check_finite_parameters(bias: RelativeBias, tensors: tuple[torch.Tensor, ...] | None = None) -> list[tuple] | None:
    """Refuse a bias module whose parameters hold NaN/inf (every output reading them would be NaN).

    Costs O(parameters) when a parameter changed since the last check (its autograd version counter or
    storage), else O(1): decoding steps and inference re-read nothing. Parameters on the meta device, which
    hold no values, and calls being compiled are skipped.

    ``tensors``: ``bias.state_tensors()`` when the caller has them.

    Returns:
        The module's :meth:`~relbias.RelativeBias.state_stamp` (None while compiling).

    Raises:
        ValueError: naming the family, the parameter and the first non-finite entry.
    """
    if torch.compiler.is_compiling():  # value checks read data: eager calls make them, compiled graphs do not
        return None
    stamp = bias.state_stamp(tensors)  # buffers too: a changed one only costs a re-check
    if bias.__dict__.get("_finite_stamp") == stamp:
        return stamp
    for name, param in bias.named_parameters():
        if param.device.type == "meta" or param.numel() == 0:
            continue
        finite = torch.isfinite(param.detach())
        if not bool(finite.all()):
            entry = tuple(int(i) for i in (~finite).nonzero()[0])
            value = float(param.detach()[entry])
            raise ValueError(
                f"{type(bias).__name__} parameter {name!r} holds {value} at entry {list(entry)}; every output that "
                f"reads it would be NaN (reinitialise or reload the parameter)"
            )
    bias.__dict__["_finite_stamp"] = stamp
    return stamp


def check_mask(mask: torch.Tensor | None, query: torch.Tensor, target: tuple[int, ...]) -> None:
    """A mask is bool (True = may attend) or float (additive, -inf = masked), broadcastable to target."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or float (additive, -inf = masked), got {mask.dtype}")
    if mask.device != query.device:
        raise ValueError(f"mask is on {mask.device} but query is on {query.device}")
    if mask.dim() == 2 and mask.shape == (target[0], target[3]) and 1 < target[0] != target[2]:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} looks like a (batch, key_len) key padding mask; a mask "
            f"broadcasts to (batch, num_heads, query_len, key_len) = {target}, so pass mask[:, None, None, :] "
            f"(True = may attend)"
        )
    check_broadcast("mask", mask, target, "(batch, num_heads, query_len, key_len)")
    check_additive_mask(mask, "mask", "a 0/1 keep mask (Hugging Face's attention_mask, 1 = attend) is passed as "
                                      "mask.bool() (True = may attend)")


def check_additive_mask(mask: torch.Tensor, name: str, advice: str) -> None:
    """A float ``mask`` is additive: finite values and -inf, and not only 0s and 1s with a 1 among them (a 0/1 keep
    or padding mask passed as float would add +1 to some logits and mask nothing). One pass over the mask (its
    minimum and maximum; the 0/1 test only where they are 0 and 1), never over the activations; skipped while
    compiling. ``advice`` says how to pass a 0/1 mask instead.

    Raises:
        ValueError: NaN or +inf in ``mask``, or a mask of 0s and 1s only (naming ``name`` and the ``advice``).
    """
    if not mask.is_floating_point() or mask.numel() == 0 or torch.compiler.is_compiling():
        return
    low, high = (float(x) for x in torch.aminmax(mask.detach()))
    if math.isnan(high) or high == float("inf"):
        raise ValueError(f"a float {name} may hold finite values and -inf only; it contains NaN or +inf")
    if high == 1.0 and low >= 0.0 and bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"a float {name} is additive (added to the scores, -inf = masked), but this one holds only 0s and 1s, "
            f"so it would mask nothing; {advice}"
        )


def check_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: object,
    mask: torch.Tensor | None,
    is_causal: bool,
    query_start: int | torch.Tensor | None,
    key_start: int | torch.Tensor,
    window: tuple[int | None, int | None] | None = None,
) -> tuple[Alignment, list[tuple] | None]:
    """Every check :func:`relbias.attention` (and ``explain_backend``) makes before choosing a backend.

    Returns the call's :class:`Alignment` and a bias module's state stamp (:func:`check_bias`); raises TypeError /
    ValueError as ``relbias.attention`` documents.
    """
    check_qkv(query, key, value)
    batch, heads, query_len, _ = query.shape
    target = (batch, heads, query_len, key.shape[2])
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    alignment = resolve_alignment(query_len, key.shape[2], query_start=query_start, key_start=key_start)
    stamp = check_bias(bias, query, target)
    if mask is not None:
        check_mask(mask, query, target)
    future_hidden = is_causal or (window is not None and window[1] == 0)  # a window (left, 0) hides them too
    if not future_hidden and isinstance(bias, RelativeBias) and not bias.bidirectional:
        _check_no_visible_future(mask, is_causal, alignment, query.device)
    return alignment, stamp


def _check_no_visible_future(mask, is_causal, alignment, device) -> None:
    """A causal-only bias has no value for future keys: some mask must hide every one of them.

    Positions that are tensors (under torch.compile, :func:`relbias.positions.resolve_alignment`) make even the
    mask-free case a value check: eager calls make it, compiled graphs do not.
    """
    if is_causal or isinstance(alignment.min_offset, torch.Tensor) or alignment.min_offset >= 0:
        return
    if mask is None:  # every future key is visible: decided by the positions alone (no tensor read)
        future_visible = True
    elif torch.compiler.is_compiling():
        return  # a value check: eager calls make it
    else:
        future_visible = None
    future = alignment.offsets(device) < 0 if future_visible is None else None
    if future is not None:
        future = future & (mask if mask.dtype == torch.bool else mask != float("-inf"))
        future_visible = bool(future.any())
    if future_visible:
        raise ValueError(
            "the bias is causal (bidirectional=False) and has no value for future keys (offset i - j < 0), "
            "but some future key is visible; pass is_causal=True or a mask that hides future keys"
        )
