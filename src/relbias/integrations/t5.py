"""The T5 patch: Hugging Face T5-family models (T5, mT5, Flan-T5, UMT5, Switch Transformers, Pop2Piano) with relbias
attention.

``patch_t5(model)`` makes the self-attention of every encoder and decoder layer compute
``softmax((q . k) + u_{b(i-j)} + Mask) v`` (T5's unscaled scores, Raffel et al. 2020, JMLR 21(140), §2.1) with
:func:`relbias.attention`, reading the model's own ``relative_attention_bias`` table through a
:class:`relbias.T5Bias` that shares its parameter. ``unpatch_t5(model)`` undoes it exactly.

How (transformers >= 5.24, < 6): each T5 attention layer asks ``compute_bias(query_length, key_length, device,
past_seen_tokens)`` for a (1, H, Lq, Lk) bias, hands it to the next layers, and calls the attention function that
``config._attn_implementation`` names. The patch

* replaces ``compute_bias`` on the layers that own a table by one returning a
  :class:`~relbias.integrations.t5_attention.T5PositionBias` (the
  ``T5Bias`` module and the positions) instead of a tensor; transformers passes it between layers as it passes
  ``position_bias``, so no (1, H, Lq, Lk) bias is built by this path;
* points the self-attention layers at a copy of their stack's config whose ``_attn_implementation`` is
  ``"relbias_t5"``, an attention function registered with transformers' ``AttentionInterface``; it converts the
  stack's 4D mask (``relbias.integrations.masks.relbias_mask_from_hf``) and calls :func:`relbias.attention`.

Projections, the KV cache (``EncoderDecoderCache``, ``past_seen_tokens``), masks' construction, cross-attention
(which has no position bias), feed-forward and generation stay transformers' own code. The model's parameters and
``state_dict`` are unchanged.

With ``patch_t5(model, process_group=...)`` every rank runs the model on its shard of each sequence: self-attention
goes through :func:`relbias.distributed.context_parallel_attention`, and a forward pre-hook on the decoder stack
all-gathers the encoder's output (and its mask) for transformers' own cross-attention.
"""

from __future__ import annotations

import inspect

from torch import nn

from .common import SUPPORTED_TRANSFORMERS, check_backend, check_model, check_transformers_version
from .loading import self_attention_modules, t5_biases_from_model
from .patches import find_patches, patched_already
from .sharded_stacks import _gather_encoder_states, _refuse_generate, _refuse_labels, distributed_group
from .t5_attention import (  # noqa: F401 - re-exported (the T5 patch's names; the private ones for pickles)
    ATTN_IMPLEMENTATION,
    T5PositionBias,
    _compute_bias,
    _ContextParallel,
    _PatchState,
    _wants_weights,
    install_stack,
    relbias_t5_attention,
    restore,
)
from .t5_tensor_parallel import check_sharded_heads

# ATTN_IMPLEMENTATION, T5PositionBias and relbias_t5_attention are importable here too; documented in t5_attention.
__all__ = ["is_patched", "patch_t5", "t5_stacks", "unpatch_t5"]

_FAMILIES = {  # modeling module -> (attention class, supported model classes)
    "t5": ("T5Attention", ("T5Model", "T5ForConditionalGeneration", "T5EncoderModel")),
    "mt5": ("MT5Attention", ("MT5Model", "MT5ForConditionalGeneration", "MT5EncoderModel")),
    "umt5": ("UMT5Attention", ("UMT5Model", "UMT5ForConditionalGeneration", "UMT5EncoderModel")),
    # Same T5 stacks and attention (transformers marks both "Copied from ... T5Attention"):
    "switch_transformers": (
        "SwitchTransformersAttention",
        ("SwitchTransformersModel", "SwitchTransformersForConditionalGeneration", "SwitchTransformersEncoderModel"),
    ),
    "pop2piano": ("Pop2PianoAttention", ("Pop2PianoForConditionalGeneration",)),
}
_MASK_IMPLEMENTATIONS = ("sdpa", "eager")
_STATE_ATTR = "_relbias_t5_patch"


def _stack_holder(model: nn.Module) -> tuple[nn.Module, type]:
    """The module whose ``encoder`` / ``decoder`` are T5-family stacks (``model`` itself, or the first submodule in
    ``named_modules`` order that has them: a T5 model inside a task head or a user's wrapper, or a wrapper holding
    ``T5Stack`` s directly) and the family's attention class, told by the stacks' self-attention modules."""
    import importlib

    attentions = {}
    for family, (attention_name, _) in _FAMILIES.items():
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        attentions[getattr(modeling, attention_name)] = family
    for path, module in model.named_modules():
        try:
            stacks = self_attention_modules(module)
        except TypeError:
            continue
        found = type(next(iter(stacks.values()))[0])
        if found in attentions:
            return module, found
        where = f"{type(model).__name__}.{path}" if path else type(model).__name__
        raise TypeError(
            f"{where} has encoder/decoder stacks whose self-attention is {found.__name__}, not one of "
            f"{', '.join(cls.__name__ for cls in attentions)} (T5, mT5, UMT5, Switch Transformers, Pop2Piano); "
            f"patch_t5 cannot run it"
        )
    raise TypeError(
        f"patch_t5 found no T5-family stack in {type(model).__name__}: no module with 'encoder' / 'decoder' stacks of "
        f"block[i].layer[0].SelfAttention (T5, mT5, UMT5, Switch Transformers and Pop2Piano models, and any module "
        f"holding them or their stacks); UDOP and Pix2Struct use the T5 bias with another attention or layout (LongT5: "
        f"relbias.integrations.longt5.patch_longt5, or patch)"
    )


def t5_stacks(model: nn.Module) -> tuple[nn.Module, type]:
    """Find the T5-family stacks :func:`patch_t5` would patch.

    Args:
        model: any module.

    Returns:
        ``(holder, attention class)``: the module whose ``encoder`` / ``decoder`` are T5-family stacks (``model``
        itself, or the first submodule in ``named_modules`` order that has them) and their self-attention class
        (``T5Attention``, ``MT5Attention``, ...).

    Raises:
        TypeError: no such stack, or stacks whose self-attention is another class (the message names it).
    """
    return _stack_holder(model)


def _check_layout(attention_cls: type) -> None:
    """The hook replaces compute_bias(query_length, key_length, device, past_seen_tokens): it must have that form."""
    params = list(inspect.signature(attention_cls.compute_bias).parameters)
    if params[1:] != ["query_length", "key_length", "device", "past_seen_tokens"]:
        raise RuntimeError(
            f"{attention_cls.__name__}.compute_bias has parameters {params[1:]}, not the (query_length, key_length, "
            f"device, past_seen_tokens) this patch was written for; use transformers{SUPPORTED_TRANSFORMERS}"
        )


def _patches(model: nn.Module):
    """The T5 patches inside ``model`` (:func:`relbias.integrations.patches.find_patches`)."""
    return find_patches(model, _STATE_ATTR, lambda state: isinstance(state, _PatchState))


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` is, or holds, a model :func:`patch_t5` (or :func:`relbias.integrations.transformers.patch`)
    has patched and :func:`unpatch_t5` has not restored (whether that model or a head holding it was patched); for
    LongT5, :func:`relbias.integrations.longt5.is_longt5_patched`; for MPNet,
    :func:`relbias.integrations.mpnet.is_mpnet_patched`; for the ALiBi decoders,
    :func:`relbias.integrations.alibi_decoders.is_alibi_patched`."""
    return bool(_patches(model))


def patch_t5(
    model: nn.Module,
    *,
    backend: str | None = None,
    process_group: object = None,
    layout: str = "contiguous",
    strategy: str = "auto",
    sync_bias_grads: bool = True,
    tensor_parallel: object = None,
) -> nn.Module:
    """Make a transformers T5-family model compute its self-attention with :func:`relbias.attention`.

    Outputs equal the unpatched model's up to float rounding (fp32: max abs difference <= 1e-5 in the tests) for the
    encoder, the decoder with and without a cache, generation, padding masks and batches; cross-attention is left
    as it is. Score convention "t5": ``(q . k) + u_{b(i-j)} + Mask``, no scaling (Raffel et al. 2020, §2.1).
    A query with no visible key (a padded position under left padding) gets transformers' result, the mean of the
    values, and its gradients (:mod:`relbias.integrations.hidden_rows`; not under ``process_group``, where it
    stays zeros). Differences: with ``output_attentions=True`` (attention implementation "eager", as transformers
    requires) self-attention weights are returned, materialised (O(B·H·L²) memory);
    attention dropout in training mode runs on relbias' counter-based mask (a different random mask than
    transformers' own, with the same distribution).

    Args:
        model: a transformers ``T5Model``, ``T5ForConditionalGeneration``, ``T5EncoderModel`` or the ``MT5...`` /
            ``UMT5...`` / ``SwitchTransformers...`` equivalent, or a ``Pop2PianoForConditionalGeneration`` (their
            self-attention is transformers' T5Attention), loaded with ``attn_implementation`` "sdpa" (the default)
            or "eager" (Switch Transformers has eager only); or any module holding one (a task head such as
            ``T5ForSequenceClassification``, a user's wrapper) or holding their stacks directly (``encoder`` /
            ``decoder`` attributes that are ``T5Stack`` s, as forecasting models such as Chronos-Bolt build): the
            first module in ``named_modules`` order with such stacks is patched. Patched in place; the same model is
            returned.
        backend: relbias backend for every self-attention layer: ``"auto"`` or a key of
            ``relbias.backends.BACKENDS``; default None: :func:`relbias.attention`'s default, read at each call
            (``"auto"``: the dispatcher picks by device, dtype, grad mode, mask and length).
        process_group: None (default), a ``torch.distributed`` process group (``torch.distributed.group.WORLD``
            for the default one) or a 1-D ``DeviceMesh`` (a named dimension of a larger mesh, ``mesh["cp"]``) over
            whose ranks every sequence is sharded along its length (context
            parallelism). Each rank then calls the model with its own shard of ``input_ids`` / ``attention_mask``
            (and of ``decoder_input_ids`` / ``decoder_attention_mask``), cut with
            :func:`relbias.distributed.shard` (``dim=1``) in ``layout``, and gets its shard of the outputs
            (encoder states, decoder states, logits), equal to the unsharded single-process model's. Encoder
            self-attention runs :func:`relbias.distributed.context_parallel_attention` (the bias table at global
            positions); decoder self-attention is the same, causal (a causal ring with ``strategy="ring"``);
            cross-attention stays transformers' own: a forward pre-hook on the decoder stack all-gathers the
            encoder's last hidden state and its attention mask (:func:`relbias.distributed.gather_sequence`,
            differentiable), so every rank's decoder shard attends to the whole memory. Under a group: no
            incremental decoding (``generate`` and a cache with past tokens raise NotImplementedError), no
            ``output_attentions``, no attention dropout in training, no ``labels`` without ``decoder_input_ids``
            (shift the full labels, then shard); the loss transformers computes is this rank's mean. Gradients:
            the ``relative_attention_bias`` tables come back summed over the group (as context_parallel_attention
            does; see ``sync_bias_grads``); every other parameter's gradient is this rank's part, to be summed over the group. Every rank
            must make the same calls with the same shapes.
        layout: with ``process_group``: "contiguous" (default) or "zigzag" (:mod:`relbias.distributed.layout`).
        strategy: with ``process_group``: "auto" (default: "ring", since T5's attention has no window), "ring",
            "ulysses" (needs num_heads % P == 0) or "halo" (the first call refuses it: T5 attends without a window).
        sync_bias_grads: with ``process_group``: True (default) sums the ``relative_attention_bias`` gradients over
            the group in backward; False leaves each rank its part, like every other parameter's, for a
            data-parallel wrapper that reduces over the group's ranks too (FSDP2 over a flattened data x context
            mesh; see :func:`relbias.distributed.context_parallel_attention`). With ``tensor_parallel`` it applies
            to that group too.
        tensor_parallel: None (default), or the process group (a 1-D ``DeviceMesh``, ``mesh["tp"]``) of tensor
            parallelism (Shoeybi et al. 2019, Megatron-LM, §3): the caller shards every attention layer's ``q``,
            ``k``, ``v`` column-wise and ``o`` row-wise (``torch.distributed.tensor.parallel.parallelize_module``
            with ``ColwiseParallel`` / ``RowwiseParallel``) and sets its ``n_heads`` to H/T and ``inner_dim`` to
            H/T x d_kv, so that rank t computes heads ``[t·H/T, (t+1)·H/T)``; the patch gives each self-attention
            layer those heads' columns of the replicated ``relative_attention_bias`` table
            (:class:`relbias.distributed.TensorParallelHeads`), and the table's gradient comes back
            whole on every rank (summed over the group: each rank's is its heads' columns). Composes with
            ``process_group`` (a 2-D mesh, ``mesh["tp"]`` and ``mesh["cp"]``). A self- or cross-attention layer
            whose ``n_heads``, ``inner_dim`` or projection shards do not hold H/T heads is refused here, at patch
            time, with a ValueError naming the layer and the recipe (docs/context-parallel.md).

    Returns:
        ``model``, patched.

    Raises:
        ImportError: transformers is not installed.
        RuntimeError: a transformers version outside
            :data:`~relbias.integrations.common.SUPPORTED_TRANSFORMERS`, or a T5 attention layout this patch does
            not know.
        TypeError: no T5-family stack in ``model``, or stacks with another self-attention (LongT5, UDOP and
            Pix2Struct use the T5 bias with another attention or layout; the message names the class found); a
            ``process_group`` that is not a process group,
            a DeviceMesh or None; a non-bool ``sync_bias_grads``.
        ValueError: an attention implementation other than "sdpa" / "eager"; an unknown backend; a DeviceMesh of
            more than one dimension as ``process_group``; ``model`` is, or holds, a model patched already with
            another backend, or either patch has a ``process_group``; under ``tensor_parallel``, heads that do not
            divide over its group, or an attention layer not sharded to H/T heads (named).

    Warns:
        UserWarning: ``model`` is, or holds, a model patched already with this backend and neither patch has a
            ``process_group`` (a head whose base model was patched, a base model patched through its head, or the
            same model twice): nothing changes (:mod:`relbias.integrations.patches`).
    """
    check_model(model, "patch_t5")
    check_transformers_version()
    holder, attention_cls = _stack_holder(model)
    _check_layout(attention_cls)
    check_backend(backend)
    patched = _patches(model)
    if patched:
        state = patched[0].state
        return patched_already(model, patched[0], "patch_t5", state.backend, backend,
                               same=process_group is None and state.parallel is None and tensor_parallel is None
                               and state.tensor_parallel is None)
    shards, tp_group = 1, None
    if tensor_parallel is not None:
        import torch.distributed as dist

        tp_group = distributed_group("patch_t5", "tensor_parallel", tensor_parallel, sync_bias_grads)
        shards = dist.get_world_size(tp_group)
    parallel = None
    if process_group is not None:
        from ..distributed.layout import check_layout
        from ..distributed.validate import STRATEGIES

        check_layout(layout)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        group = distributed_group("patch_t5", "process_group", process_group, sync_bias_grads)
        parallel = _ContextParallel(group, layout, strategy, sync_bias_grads)

    stacks = self_attention_modules(holder)
    for name, attentions in stacks.items():
        implementation = getattr(holder, name).config._attn_implementation
        if implementation not in _MASK_IMPLEMENTATIONS:
            raise ValueError(
                f"{name} uses attn_implementation={implementation!r}; patch_t5 reads the masks of "
                f"{_MASK_IMPLEMENTATIONS}: load the model with attn_implementation='sdpa'"
            )
        for layer, module in enumerate(attentions):
            if type(module) is not attention_cls:
                raise TypeError(f"{name} layer {layer} is a {type(module).__name__}, expected {attention_cls.__name__}")

    biases = t5_biases_from_model(holder, share_weights=True, head_shards=shards)
    state = _PatchState(backend=backend, configs=[], hooked=[], parallel=parallel,
                        tensor_parallel=tensor_parallel,
                        sync_bias_grads=sync_bias_grads)
    if tensor_parallel is not None:
        from ..distributed.tensor_parallel import rank_heads

        for name in stacks:  # refused now, not at the first call: heads that do not divide over the group
            for bias in biases.stack(name):
                rank_heads(bias.num_heads, tp_group)
        heads = biases.stack(next(iter(stacks)))[0].num_heads  # every table of the model has the config's H
        check_sharded_heads(holder, attention_cls, heads, shards)  # and layers the caller did not shard
    for name, attentions in stacks.items():
        install_stack(state, getattr(holder, name), attentions, biases.stack(name))
    if parallel is not None:
        decoder = getattr(holder, "decoder", None)
        if decoder is not None:
            state.handles.append(decoder.register_forward_pre_hook(_gather_encoder_states(parallel), with_kwargs=True))
            state.handles.append(model.register_forward_pre_hook(_refuse_labels, with_kwargs=True))
        if hasattr(model, "generate"):
            model.generate = _refuse_generate
            state.replaced_generate = True
            state.generate_owner = model
    setattr(holder, _STATE_ATTR, state)  # on the module it changes: a head holding it, or it alone, sees it
    return model


def unpatch_t5(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_t5`: restore every attention layer's config and ``compute_bias`` exactly, in every patched
    model inside ``model`` (the model patched, or a head holding it: either may be handed here).

    Args:
        model: a model patched by :func:`patch_t5`, or a module holding one.

    Returns:
        ``model``, computing attention with transformers' own code again.

    Raises:
        ValueError: ``model`` neither is nor holds a model patched by :func:`patch_t5`.
    """
    patched = _patches(model)
    if not patched:
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch_t5)")
    for _, holder, state in patched:
        restore(state)
        if state.replaced_generate:
            del (holder if state.generate_owner is None else state.generate_owner).generate
        delattr(holder, _STATE_ATTR)
    return model
