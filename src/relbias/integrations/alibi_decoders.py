"""Run Hugging Face's ALiBi decoders (BLOOM, MPT, Falcon with ``alibi=True``) with relbias attention.

ALiBi (Press et al. 2022, "Train Short, Test Long", ICLR, §3) penalises a past key linearly in its distance:
``-m_h * (i - j)``, a slope ``m_h`` per head. transformers (>= 5.24, < 6) builds it per key instead, as
``m_h * position(j)`` (softmax is invariant to a constant per query row), and adds it in eager attention:

* BLOOM: ``position(j)`` counts the visible tokens before ``j`` (the 2-D attention mask's cumulative sum);
  scores ``(q . k) / sqrt(d) + bias`` ("additive"); a (B·H, 1, Lk) bias and a float (B, 1, Lq, Lk) mask.
* MPT: ``position(j) = j`` (padding counts), a (H, 1, max_seq_len) bias sliced to the keys, which refuses
  sequences past ``config.max_seq_len`` (it cannot broadcast); scores ``(q . k) * softmax_scale + bias``
  ("additive"); slopes :func:`relbias.mpt_alibi_slopes` of ``attn_config.alibi_bias_max``.
* Falcon (``alibi=True``: falcon-rw): as BLOOM's, the slopes and products rounded to bfloat16, with scores
  ``(q . k + bias) / sqrt(d)`` (the "seed" convention); the model folds the bias into a (B, H, Lq, Lk) float mask,
  built once per forward.

:func:`patch_alibi` replaces, on the instances, each attention layer's ``forward`` by one that computes the same
projections and cache update as transformers' and calls :func:`relbias.attention` with one
:class:`relbias.ALiBiBias` (causal, the model's own slopes) read per offset: O(H) bias memory, no (Lq, Lk) bias.
Falcon's model is told not to build its bias (``use_alibi`` set to False on the instance while patched; its
attention mask stays transformers'). Embeddings, masks' construction, caches (``DynamicCache``, ``StaticCache``),
generation (greedy, sampling, beam search) and the heads stay transformers' code; parameters and ``state_dict``
are unchanged.

Exactness. Offsets ``i - j`` equal BLOOM's and Falcon's counted positions' differences when each row's visible
keys are contiguous (no padding, left padding, right padding): then the bias is read per offset. A mask with
hidden keys between visible ones (or one under ``torch.compile``, whose values are not read) takes the exact
path instead: the model's own per-key bias, materialised as a (B, H, Lq, Lk) float mask, as transformers does.
MPT's positions are offsets whatever the mask. transformers' Falcon rounds each ``m_h * position`` to bfloat16:
exact only where those products are (below 256 tokens with 1, 2, 4 or 8 heads), else off by up to 2^-7 of the
product (falcon-rw-1b's 32 heads: from position 3); relbias computes ALiBi exactly with Falcon's slopes
(:mod:`relbias.integrations.falcon`). transformers 5.24's eager Falcon adds the bias twice (in its scores and in
the mask its model folds it into); the patch follows the sdpa path, which adds it once, as both paths do from 5.25.
"""

from __future__ import annotations

from torch import nn

from ..biases.alibi import ALiBiBias
from . import bloom, falcon, mpt
from .alibi_common import (  # noqa: F401 - re-exported (pickles made before they moved name them here)
    ALiBiPatch,
    _contiguous,
    alibi_attention,
    dropout_probability,
    replace_forwards,
)
from .common import check_backend, check_model, check_transformers_version
from .patches import find_patches, patched_already

__all__ = [
    "ARCHITECTURES", "ALiBiPatch", "alibi_attention", "alibi_decoder", "dropout_probability", "is_alibi_patched",
    "patch_alibi", "replace_forwards", "unpatch_alibi",
]

#: Modules under ``relbias.integrations`` that each patch one ALiBi architecture; see :func:`patch_alibi`.
ARCHITECTURES = ("bloom", "mpt", "falcon")
_STATE_ATTR = "_relbias_alibi_patch"
_MODULES = {"bloom": bloom, "mpt": mpt, "falcon": falcon}


def _architecture(name: str):
    """The module of an architecture of :data:`ARCHITECTURES` by name."""
    return _MODULES[name]


def alibi_decoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(architecture, base model)``: the first ``BloomModel``, ``MptModel`` or ``FalconModel`` in ``model``
    (the model itself, a task head's, a wrapper's), or None (none, or transformers not installed)."""
    for name in ARCHITECTURES:
        base = _architecture(name).base_model(model)
        if base is not None:
            return name, base
    return None


def _patches(model: nn.Module):
    """The ALiBi patches inside ``model`` (:func:`relbias.integrations.patches.find_patches`)."""
    return find_patches(model, _STATE_ATTR, lambda state: isinstance(state, ALiBiPatch))


def is_alibi_patched(model: nn.Module) -> bool:
    """True when ``model`` is, or holds, a model :func:`patch_alibi` has patched and :func:`unpatch_alibi` has not
    restored (whether the base model or a head holding it was handed to :func:`patch_alibi`)."""
    return bool(_patches(model))


def patch_alibi(model: nn.Module, *, backend: str | None = None) -> nn.Module:
    """Make the BLOOM, MPT or ALiBi Falcon decoder in ``model`` compute its attention with :func:`relbias.attention`.

    Outputs equal the unpatched model's up to float rounding (float32: within 1e-5 in the tests; greedy and beam
    tokens identical), with left or right padding, a ``DynamicCache`` or ``StaticCache``; see the module docstring
    for how each model's bias is read and where Falcon's bfloat16 rounding makes transformers' bias differ from
    ALiBi's. MPT takes the slopes transformers' MPT uses (``alibi_bias_max`` 8; a config with another value gets a
    warning). A query with no visible key (a left pad) gets transformers' result, the mean of the values, and its
    gradients (:mod:`relbias.integrations.hidden_rows`). Differences: attention dropout in training runs on relbias'
    counter-based mask (the same distribution, another mask; none on those rows); ``output_attentions`` returns the
    probabilities, materialised (O(B·H·Lq·Lk)). A patched MPT runs past ``config.max_seq_len`` (ALiBi needs no
    table; transformers' MPT fails there to broadcast its bias): how well a model does there is the model's matter.

    Args:
        model: a ``BloomModel``/``MptModel``/``FalconModel``, a ``...ForCausalLM`` or other head, or any module
            holding one: the first such base model in it is patched, in place.
        backend: a relbias backend name for every layer, or None (default): :func:`relbias.attention`'s default.

    Returns:
        ``model``, patched.

    Raises:
        TypeError: no BLOOM, MPT or Falcon model in ``model``; a Falcon with ``alibi=False`` (rotary embeddings,
            no relative bias).
        ValueError: an unknown backend; ``model`` is, or holds, a model patched already with another backend.

    Warns:
        UserWarning: ``model`` is, or holds, a model patched already with this backend (a head whose base model
            was patched, a base model patched through its head, or the same model twice): nothing changes
            (:mod:`relbias.integrations.patches`).
    """
    check_model(model, "patch_alibi")
    found = alibi_decoder(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} holds no transformers BLOOM, MPT or Falcon model")
    check_transformers_version()
    name, base = found
    check_backend(backend)
    patched = _patches(model)
    if patched:
        return patched_already(model, patched[0], "patch_alibi", patched[0].state.backend, backend)
    module = _architecture(name)
    module.check(base)
    slopes = module.slopes(base)
    patch = ALiBiPatch(name, base, ALiBiBias(len(slopes), bidirectional=False, slopes=slopes), backend, [])
    module.install(base, patch)
    setattr(base, _STATE_ATTR, patch)  # on the model it changes: a head holding it, or it alone, sees it
    return model


def unpatch_alibi(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_alibi`: transformers' own attention again, exactly, in every patched model inside ``model``
    (the base model, or the head it was patched through: either may be handed here).

    Returns:
        ``model``, unpatched.

    Raises:
        ValueError: ``model`` neither is nor holds a model patched by :func:`patch_alibi`.
    """
    patched = _patches(model)
    if not patched:
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch_alibi)")
    for _, holder, patch in patched:
        for layer in patch.layers:
            del layer.forward  # transformers' own forward again
        _architecture(patch.architecture).uninstall(patch.base, patch)
        delattr(holder, _STATE_ATTR)
    return model
