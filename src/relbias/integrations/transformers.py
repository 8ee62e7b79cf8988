"""``patch(model)`` / ``unpatch(model)``: Hugging Face transformers models computing their attention with relbias.

The front door: it tells the architecture and hands the model to its patch, one module per family beside this one:

* :mod:`relbias.integrations.t5`: T5, mT5, UMT5, Switch Transformers, Pop2Piano (``patch_t5``; re-exported here);
* :mod:`relbias.integrations.longt5`: LongT5, local and transient-global (``patch_longt5``);
* :mod:`relbias.integrations.mpnet`: MPNet and sentence-transformers holding one (``patch_mpnet``);
* :mod:`relbias.integrations.alibi_decoders`: BLOOM, MPT, Falcon with ``alibi=True`` (``patch_alibi``; the
  architectures in ``bloom``, ``mpt``, ``falcon``).

Imports point one way: this module imports the families, the families import the shared helpers
(:mod:`relbias.integrations.common`, ``t5_attention`` (the T5 layer, also LongT5's decoder), ``alibi_common`` (the
ALiBi layers), ``masks``, ``hidden_rows``, ``loading``, ``patches`` (where a patch lives)), and no helper imports a
family.
Every name this module exported before the families had modules of their own is still importable from here.
"""

from __future__ import annotations

from torch import nn

from . import common, t5
from .common import (  # noqa: F401 - re-exported (and the private names, for code that imported them from here)
    _MAX_VERSION,
    _MIN_VERSION,
    _backend_names,
    _check_backend,
    _first_instance,
    check_model,
    check_transformers_version,
)
from .t5 import (  # noqa: F401 - re-exported; the private classes keep pickles made before the move loadable
    _FAMILIES,
    _MASK_IMPLEMENTATIONS,
    _STATE_ATTR,
    T5PositionBias,
    _compute_bias,
    _ContextParallel,
    _PatchState,
    _stack_holder,
    _wants_weights,
    is_patched,
    patch_t5,
    relbias_t5_attention,
    unpatch_t5,
)

#: Range of transformers versions the patches support, as a pip specifier
#: (:data:`relbias.integrations.common.SUPPORTED_TRANSFORMERS`).
SUPPORTED_TRANSFORMERS = common.SUPPORTED_TRANSFORMERS
#: Name of the T5 patch's attention function in transformers' ``AttentionInterface``
#: (:data:`relbias.integrations.t5_attention.ATTN_IMPLEMENTATION`).
ATTN_IMPLEMENTATION = t5.ATTN_IMPLEMENTATION

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_TRANSFORMERS",
    "T5PositionBias",
    "check_transformers_version",
    "is_patched",
    "patch",
    "relbias_t5_attention",
    "patch_t5",
    "unpatch",
    "unpatch_t5",
]


def patch(
    model: nn.Module,
    *,
    backend: str | None = None,
    process_group: object = None,
    layout: str = "contiguous",
    sync_bias_grads: bool = True,
) -> nn.Module:
    """Make a transformers model with an offset-only relative bias compute its attention with relbias.

    Recognises, in this order: LongT5 and any module holding its stacks
    (:func:`relbias.integrations.longt5.patch_longt5`: local and transient-global encoders), the T5 family and any
    module holding its stacks (:func:`relbias.integrations.t5.patch_t5`: T5, mT5, UMT5, Switch Transformers,
    Pop2Piano, task heads and wrappers, Chronos-Bolt), then MPNet and any module holding an ``MPNetEncoder``
    (:func:`relbias.integrations.mpnet.patch_mpnet`: every MPNet head, a sentence-transformers
    ``SentenceTransformer``), then the ALiBi decoders BLOOM, MPT and Falcon with ``alibi=True``
    (:func:`relbias.integrations.alibi_decoders.patch_alibi`). Outputs equal the unpatched model's up to float
    rounding; ``state_dict`` and ``save_pretrained`` are unchanged.

    Args:
        model: the model, patched in place.
        backend: a relbias backend name, or None (default): :func:`relbias.attention`'s default ("auto").
        process_group: None (default), or the process group (or 1-D DeviceMesh) of context parallelism, for
            LongT5 and the T5 family (each rank passes its shard of every sequence; see ``patch_longt5`` and
            ``patch_t5``).
        layout: with ``process_group``: the sequences' layout, "contiguous" (default) or, for the T5 family,
            "zigzag".
        sync_bias_grads: with ``process_group``: sum the position-bias tables' gradients over the group (default
            True).

    Returns:
        ``model``, patched.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (a checkpoint's name, say: the message says how to load
            it); no architecture relbias patches in ``model`` (the message lists them); and the errors of the
            patch that applies (e.g. a Falcon with rotary embeddings).
        ValueError: as that patch (unknown backend, patched already with another backend, ...); a
            ``process_group`` for MPNet or an ALiBi decoder (context parallelism is offered for LongT5 and the T5
            family).

    Warns:
        UserWarning: ``model`` is, or holds, a patched model (a base model patched through its head too) with the
            same settings: nothing changes; a second patch is never stacked on the first
            (:mod:`relbias.integrations.patches`).
    """
    from .alibi_decoders import alibi_decoder, patch_alibi
    from .longt5 import longt5_holder, patch_longt5
    from .mpnet import mpnet_encoder, patch_mpnet
    from .t5 import t5_stacks

    check_model(model, "patch")
    check_transformers_version()
    parallel = {} if process_group is None else dict(
        process_group=process_group, layout=layout, sync_bias_grads=sync_bias_grads)
    if longt5_holder(model) is not None:
        return patch_longt5(model, backend=backend, **parallel)
    try:
        t5_stacks(model)
    except TypeError as refusal:
        for found, patch_family in ((mpnet_encoder, patch_mpnet), (alibi_decoder, patch_alibi)):
            if found(model) is not None:
                if parallel:
                    raise ValueError(
                        f"patch(process_group=...): context parallelism is offered for LongT5 and the T5 family; "
                        f"{type(model).__name__} is patched by {patch_family.__name__}, which takes no process group"
                    ) from None
                return patch_family(model, backend=backend)
        raise TypeError(
            f"relbias patches T5-family models (and modules holding their stacks), MPNet models (and modules "
            f"holding an MPNetEncoder), the ALiBi decoders BLOOM, MPT and Falcon (alibi=True) and LongT5 models; "
            f"{type(model).__name__} is none of them: {refusal}"
        ) from None
    return patch_t5(model, backend=backend, **parallel)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: transformers' own attention again, exactly, in every model inside ``model`` that relbias
    patched, whichever was handed to :func:`patch` (a base model or the head holding it), in any order
    (:mod:`relbias.integrations.patches`).

    Args:
        model: a model patched by :func:`patch` (or by one family's patch function), or a module holding one.

    Returns:
        ``model``, unpatched.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``model`` neither is nor holds a model patched by relbias.
    """
    from .alibi_decoders import is_alibi_patched, unpatch_alibi
    from .longt5 import is_longt5_patched, unpatch_longt5
    from .mpnet import is_mpnet_patched, unpatch_mpnet

    check_model(model, "unpatch")
    undone = False
    for patched, undo in ((is_longt5_patched, unpatch_longt5), (is_patched, unpatch_t5),
                          (is_mpnet_patched, unpatch_mpnet), (is_alibi_patched, unpatch_alibi)):
        if patched(model):
            undo(model)
            undone = True
    if not undone:
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch)")
    return model
