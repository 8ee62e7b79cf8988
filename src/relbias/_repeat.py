"""Repeated inference calls: validation and the backend choice made once per call signature.

The layers of a decoder call :func:`relbias.attention` with the same shapes, dtypes, devices, bias module and options
at every decoding step, and a benchmark or a serving loop repeats one call. Everything
:func:`relbias.call.make_call` checks and :func:`relbias.dispatch.resolve_backend` decides for such a call follows
from that signature, except what reads values, which every repeat reads again:

* the bias module's parameters and buffers: their :meth:`~relbias.RelativeBias.state_stamp` (identity, storage,
  autograd version counter and dtype of each; the kept stamp holds the tensors, so no replacement can take their
  place) must equal the one taken when the signature was validated, whose finiteness check it stands for (a
  parameter written in place, replaced or cast sends the call down the full path; a write through ``.data`` is not
  seen, as autograd does not see it);
* NaN/inf in keys or values that some query cannot see
  (:attr:`~relbias.call.AttentionCall.hidden_keys_finite`): read on every repeat of a signature that hides keys,
  unless the backend confines them itself (:meth:`~relbias.backends.base.Backend.confines_non_finite`, as the native
  decode kernel does); a non-finite one sends the call down the full path, which chooses a backend that confines it.

A repeat then costs a dictionary lookup, the stamp and the backend's forward, or where the backend gives one its
:meth:`~relbias.backends.base.Backend.repeat_runner` (the decode backend's native kernel call, with the strides and
the native kernels' availability read again). Kept are inference calls (grad mode off, outside ``torch.compile``)
without a mask, dropout, window, grouped-query heads or tensor positions, whose arguments have exactly the types
validation accepted (plain tensors, bools, ints, floats, strs), and only where every backend consulted is
:attr:`~relbias.backends.base.Backend.repeatable` (its reasons read nothing but the signature, the bias state and
``hidden_keys_finite``); every other call takes the full path. The signature includes the bias module's attributes
that validation reads (``num_heads``, ``bidirectional``, ``default_convention``); derived values that hold the
bias's values are kept only for a ``state_only`` family, whose values read its parameters and buffers alone. A
change to the registry of backends forgets every signature (a choice made while it changed is not kept). The memo
holds the bias module by weak reference and at most :data:`MAX_SIGNATURES` signatures (a growing KV cache makes one
per decoding step, shared by its layers).
"""

from __future__ import annotations

import threading
import weakref

import torch

from .backends import registry
from .backends.base import Backend
from .biases.base import RelativeBias
from .call import SIGNATURE_DERIVED, STATE_DERIVED, AttentionCall

__all__ = ["MAX_SIGNATURES", "forget", "remember", "run", "signature"]

#: Signatures kept; the oldest is dropped first.
MAX_SIGNATURES = 64

#: signature -> (bias weakref or None, registry generation, backend, the call's fields (None where a repeat
#: brings its own: query, key, value, bias, return_lse, _cache), bias stamp, whether it hides keys, derived values,
#: the backend's repeat runner or None)
_PLANS: dict[tuple, tuple] = {}
_LOCK = threading.Lock()  # for remember's eviction; run reads without it (one dict lookup)

_Tensor = torch.Tensor
_NUMBERS = (float, int)
# module globals: a decoding step reads them with cold caches, where each lookup in torch's namespaces costs
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling  # dynamo knows the function itself: True while it traces
_inference_mode = torch.is_inference_mode_enabled
_new = object.__new__
_set_attribute = object.__setattr__


def signature(query, key, value, bias, mask, is_causal, scale, convention, query_start, key_start, backend,
              return_lse, dropout_p, generator, attn_mask, enable_gqa, window) -> tuple | None:
    """The memo key of a call to :func:`relbias.attention` (its arguments, in its order), or None for a call that is
    not kept (see the module's docstring). Reads no tensor value."""
    if (mask is not None or attn_mask is not None or window is not None or generator is not None
            or enable_gqa is not False or _grad_enabled() or _compiling()):
        return None
    if not (type(query) is _Tensor and type(key) is _Tensor and type(value) is _Tensor):
        return None
    if not ((is_causal is True or is_causal is False) and (return_lse is True or return_lse is False)
            and type(dropout_p) in _NUMBERS and dropout_p == 0 and type(key_start) is int
            and (query_start is None or type(query_start) is int) and (scale is None or type(scale) in _NUMBERS)
            and (convention is None or type(convention) is str) and type(backend) is str
            and (bias is None or isinstance(bias, RelativeBias))):
        return None
    # the bias module's attributes that validation reads (not in its state stamp); an unhashable one (a user
    # family's) makes the key unhashable, and run and remember then leave the call to the full path
    config = None if bias is None else (bias.num_heads, getattr(bias, "bidirectional", None), bias.default_convention)
    return (id(bias), config, query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device,
            key.device, value.device, is_causal, scale, convention, query_start, key_start, backend, return_lse,
            _inference_mode())


def _plan(key: tuple, bias: RelativeBias | None) -> tuple | None:
    """The kept plan of the signature ``key`` when it still holds for ``bias`` (the registry unchanged, the same bias
    module, its state stamp equal), else None."""
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable bias attribute
        return None
    if plan is None:
        return None
    ref, generation, stamp = plan[0], plan[1], plan[4]
    if generation != registry.generation() or (ref is not None and ref() is not bias):
        return None
    if bias is not None and bias.state_stamp() != stamp:
        return None
    return plan


def run(key: tuple, query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor, bias: RelativeBias | None,
        return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(out, lse)`` of a repeat of the signature ``key`` (:func:`signature`) on these tensors, or None when the
    signature is not kept or the values it cannot vouch for changed (then the caller takes the full path). Runs the
    backend's :meth:`~relbias.backends.base.Backend.repeat_runner` where it kept one and it runs these tensors, else
    the backend's forward on the kept call's fields with these tensors."""
    plan = _plan(key, bias)
    if plan is None:
        return None
    runner = plan[7]
    if runner is not None:
        result = runner(query, key_, value)
        if result is not None:
            return result
    repeated = _recall(plan, query, key_, value, bias, return_lse)
    if repeated is None:
        return None
    backend, call = repeated
    return backend.forward(call)


def _recall(plan: tuple, query, key_, value, bias, return_lse) -> tuple[Backend, AttentionCall] | None:
    """``(backend, call)``: the kept plan's validated call on these tensors, or None where NaN/inf in keys some query
    cannot see would reach that query under the plan's backend."""
    _, _, backend, fields, _, hides, derived, _ = plan
    state = fields.copy()  # the validated call's fields on these tensors, without __init__'s keyword binding
    state["query"], state["key"], state["value"], state["bias"] = query, key_, value, bias
    state["return_lse"], state["_cache"] = return_lse, derived.copy()
    call = _new(AttentionCall)
    _set_attribute(call, "__dict__", state)  # every field in one dict, sized once
    if hides and not backend.confines_non_finite(call) and not call.hidden_keys_finite:
        return None
    return backend, call


def remember(key: tuple, name: str, backend: Backend, call: AttentionCall, generation: int) -> None:
    """Keep the validated ``call`` and the ``backend`` that runs it, chosen for ``backend=name`` against the registry
    of ``generation`` (:func:`relbias.backends.registry.generation`, read before the choice), under the signature
    ``key`` (:func:`signature`), where every backend consulted is repeatable and the registry has not changed since."""
    try:
        hash(key)
    except TypeError:  # an unhashable bias attribute
        return
    backends = dict(registry.BACKENDS)
    if generation != registry.generation() or backends.get(backend.name) is not backend:
        return  # the registry changed while the call ran: its choice may not be the registry's now
    names = list(backends)
    consulted = names[: names.index(backend.name) + 1] if name == "auto" else [backend.name]
    if not all(backends[n].repeatable for n in consulted):
        return
    hides = call.hides_keys
    if hides and not call._cache.get("hidden_keys_finite", True):  # chosen around NaN/inf: not the signature's choice
        return
    bias = call.bias
    kept = SIGNATURE_DERIVED + (STATE_DERIVED if bias is not None and bias.state_only else ())
    derived = {n: call._cache[n] for n in kept if n in call._cache}
    if not hides:
        derived["hidden_keys_finite"] = True
    fields = dict(call.__dict__, query=None, key=None, value=None, bias=None, return_lse=None, _cache=None)
    # a runner may hold the bias's values: kept where they read the bias's parameters and buffers alone
    runner = backend.repeat_runner(call) if bias is None or bias.state_only else None
    plan = (None if bias is None else weakref.ref(bias), generation, backend, fields,
            call._cache.get("bias_stamp") if bias is not None else None, hides, derived, runner)
    with _LOCK:
        while len(_PLANS) >= MAX_SIGNATURES:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan


def forget() -> None:
    """Drop every kept signature."""
    with _LOCK:
        _PLANS.clear()
