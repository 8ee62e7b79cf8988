"""The LongT5 patch: Hugging Face LongT5 models (long-t5-local, long-t5-tglobal) with relbias attention.

LongT5 (Guo et al. 2022, "LongT5: Efficient Text-To-Text Transformer for Long Sequences", NAACL Findings, §3.1)
keeps T5's decoder and replaces the encoder's self-attention by

* **local attention**: query ``i`` sees the keys ``|i - j| <= r`` (``r = config.local_radius``) with T5's bucketed
  bias ``u_{b(i-j)}`` (bidirectional), unscaled scores: ``softmax((q . k) + u_{b(i-j)} + Mask) v``;
* **transient-global attention** (TGlobal): the local keys plus one summary key per ``g = config.global_block_size``
  tokens. The summary of block ``c`` is the *sum* of the layer's input states of its tokens (the last, incomplete
  block's tokens join the block before it; padding joins none), put through the layer's own
  ``global_input_layer_norm`` (T5's RMS norm) and the layer's ``k`` / ``v`` projections. Query ``i``, in block
  ``c_i``, sees every summary of its sequence with a second bucketed bias ``w_{b(c - c_i)}`` over block distances
  (``global_relative_attention_bias``); summaries of blocks with no token are hidden.

transformers (>= 5.24, < 6) computes local attention in blocks of ``r + 1`` tokens, each against itself and both
neighbours (``3 (r + 1)`` keys per query, the band applied as a mask, the bias materialised per block), and TGlobal's
side bias as a (B, N, N / g, H) tensor. :func:`patch_longt5` replaces, on the instances, each encoder layer's
``forward`` by one that keeps transformers' projections and calls

1. :func:`relbias.attention` once over the whole sequence with ``window=(r, r)``, the first layer's table as a
   :class:`relbias.T5Bias` (as transformers, every layer reads layer 0's tables) and the key padding mask: time and
   memory O(N·r);
2. for TGlobal, a second call over the summary keys: the queries of each block position ``t`` (``i = c·g + t``) form
   one batch row, in which query ``c`` and summary key ``c'`` sit at positions ``c`` and ``c'``, so that the side bias
   is an offset bias (a :class:`relbias.T5Bias` sharing ``global_relative_attention_bias``), read per offset, never
   materialised. The few tokens of an incomplete last block, whose block is the one before, are computed apart
   (a (tokens, N / g) product). Both parts are merged exactly by log-sum-exp
   (:func:`relbias.distributed.merge_partials`);

and the decoder's self-attention as :func:`relbias.integrations.t5.patch_t5` runs it (the same
``compute_bias`` / ``"relbias_t5"`` attention function). Cross-attention, feed-forward, masks' construction and
generation stay transformers' code; parameters and ``state_dict`` are unchanged.

Padding: transformers hides a key with ``-1e10`` added to its score. A query that is itself padding sees no key of
its own block band, and gets, as in transformers, the mean of the values of its three blocks' slots (zeros past the
sequence's ends) — local attention — or, with TGlobal, 0 when its sequence has summaries of empty blocks (padding
sees those; their states, keys and values are 0) and otherwise the mean of its three blocks' slots and every summary.
The patch gives those rows the same values and gradients (softmax at uniform weights, which reach queries, keys and
both tables): without gradients from per-block sums of the values (O(N·D)), with them by scoring the blocks that hold
padding against their slots (and the summaries), as transformers scores every row. The fused calls take padding as a
key padding mask; without gradients nothing of size (N, N) or (N, N / g) is built, so padding costs no more than the
tokens it replaces. No real token's output depends on a padded row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from ..biases.t5 import T5Bias
from ..distributed.merge import merge_partials
from ..functional import attention
from .common import check_backend, check_model, check_transformers_version
from .longt5_attention import _global_part, _key_mask, _padding_rows, _shared_bias
from .longt5_parallel import sharded_encoder_forward
from .patches import find_patches, patched_already
from .sharded_stacks import _gather_encoder_states, _refuse_generate, _refuse_labels, distributed_group
from .t5_attention import _ContextParallel, _PatchState, install_stack, restore

__all__ = ["LongT5Patch", "is_longt5_patched", "longt5_holder", "patch_longt5", "unpatch_longt5"]

_STATE_ATTR = "_relbias_longt5_patch"
_ENCODER_TYPES = ("local", "transient-global")
_MASK_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class LongT5Patch:
    """Kept on the patched model (attribute ``_relbias_longt5_patch``; the module holding the stacks) so that
    :func:`unpatch_longt5` can restore it.

    Attributes:
        backend: relbias backend name, or None for :func:`relbias.attention`'s default.
        kind: the encoder's ``encoder_attention_type``, "local" or "transient-global"; None without an encoder.
        first: the encoder's first self-attention module (it holds the tables every layer reads).
        local_bias: a bidirectional :class:`relbias.T5Bias` sharing ``first.relative_attention_bias.weight``.
        global_bias: TGlobal: a bidirectional :class:`relbias.T5Bias` sharing
            ``first.global_relative_attention_bias.weight``; None for local attention.
        layers: the encoder attention modules given an instance-level ``forward``.
        decoder: the decoder's T5 patch state (:func:`relbias.integrations.t5_attention.install_stack`), or None.
        parallel: None, or the process group and settings of ``patch_longt5(process_group=...)``.
        replaced_generate: the holder's ``generate`` was replaced by one that refuses (context parallelism).
    """

    backend: str | None
    kind: str | None
    first: nn.Module | None
    local_bias: T5Bias | None
    global_bias: T5Bias | None
    layers: list = field(default_factory=list)
    decoder: _PatchState | None = None
    parallel: _ContextParallel | None = None
    replaced_generate: bool = False


def longt5_holder(model: nn.Module) -> nn.Module | None:
    """The first module of ``model`` (in ``named_modules`` order, ``model`` itself first) whose ``encoder`` or
    ``decoder`` is a transformers ``LongT5Stack`` (a ``LongT5Model``, ``LongT5ForConditionalGeneration``,
    ``LongT5EncoderModel``, or a wrapper's), or None (none, or transformers not installed)."""
    try:
        from transformers.models.longt5.modeling_longt5 import LongT5Stack
    except ImportError:
        return None
    for _, module in model.named_modules():
        if isinstance(getattr(module, "encoder", None), LongT5Stack) or isinstance(
            getattr(module, "decoder", None), LongT5Stack
        ):
            return module
    return None


def _patches(model: nn.Module):
    """The LongT5 patches inside ``model`` (:func:`relbias.integrations.patches.find_patches`)."""
    return find_patches(model, _STATE_ATTR, lambda state: isinstance(state, LongT5Patch))


def is_longt5_patched(model: nn.Module) -> bool:
    """True when ``model`` is, or holds, a model :func:`patch_longt5` has patched and :func:`unpatch_longt5` has not
    restored (whether that model or a module holding it was handed to :func:`patch_longt5`)."""
    return bool(_patches(model))


def _transformers_forward(module, patch, hidden_states, mask, position_bias):
    """transformers' own blocked attention for ``output_attentions=True`` (weights in its block layout), with the
    first layer's position bias as transformers builds it when the previous layer did not hand it on."""
    from transformers.models.longt5 import modeling_longt5 as hf

    if not isinstance(position_bias, torch.Tensor):
        first, dtype = patch.first, hidden_states.dtype
        position_bias = first.compute_bias(module.block_len)
        if patch.kind == "local":
            if mask is not None:
                position_bias = position_bias + torch.where(mask > 0, 0.0, -1e10).transpose(1, 2)
        else:
            if mask is not None:
                local = hf._get_local_attention_mask(mask, module.block_len, hidden_states.device)
                position_bias = position_bias + torch.where(local > 0, 0.0, -1e10).transpose(1, 2)
            position_bias = position_bias.type(dtype)
            side_mask = mask if mask is not None else torch.ones(hidden_states.shape[:2])
            _, segments = hf._make_global_fixed_block_ids(side_mask, module.global_block_size)
            side = first.compute_side_bias(side_mask, segments)
            side = hf._split_into_blocks(side, module.block_len, dim=-2).transpose(1, 2)
            position_bias = torch.cat([position_bias, side.type(dtype).to(position_bias.device)], dim=-1)
    return type(module).forward(module, hidden_states, mask=mask, position_bias=position_bias, output_attentions=True)


def _encoder_forward(module, patch, hidden_states, mask=None, position_bias=None, output_attentions=False):
    """Replacement of ``LongT5LocalAttention.forward`` / ``LongT5TransientGlobalAttention.forward``.

    Args:
        module: the layer; patch: the :class:`LongT5Patch`.
        hidden_states: (B, N, d_model), the layer-normed input.
        mask: what the stack hands the layer: local attention's (B, 1, N / (r + 1), r + 1, 3 (r + 1)) block mask,
            TGlobal's (B, N) attention mask, or None (no padding).
        position_bias: ignored (every layer reads the first layer's tables), except with ``output_attentions``.
        output_attentions: True runs transformers' own attention (its weights, materialised per block).

    Returns:
        ``(output (B, N, d_model), None)``; with ``output_attentions``, transformers' ``(output, position_bias,
        weights)``.
    """
    if output_attentions:
        return _transformers_forward(module, patch, hidden_states, mask, position_bias)
    b, n, _ = hidden_states.shape
    h, d = module.n_heads, module.key_value_proj_dim
    local = patch.kind == "local"

    def heads(x):  # (B, N, H·D) -> (B, H, N, D)
        return x.view(b, n, h, d).transpose(1, 2)

    query, key, value = heads(module.q(hidden_states)), heads(module.k(hidden_states)), heads(module.v(hidden_states))
    real = _key_mask(module, mask, n, local)  # (B, N) bool or None
    padded = real is not None and not bool(real.all())
    kept = n  # the positions from ``kept`` on are padding in every row (right padding): no call reads them
    if padded:
        seen = real.any(0).nonzero()  # positions real in some row
        kept = int(seen.max()) + 1 if len(seen) else 1
    dropout = float(module.dropout) if module.training else 0.0
    backend = {} if patch.backend is None else {"backend": patch.backend}
    bias = _shared_bias(patch.local_bias, patch.first.relative_attention_bias.weight)
    call = dict(
        bias=bias, mask=real[:, None, None, :kept] if padded else None, convention="t5", query_start=0, key_start=0,
        window=(module.local_radius, module.local_radius), dropout_p=dropout, **backend,
    )
    q_kept, k_kept, v_kept = query[:, :, :kept], key[:, :, :kept], value[:, :, :kept]
    if local:
        out = attention(q_kept, k_kept, v_kept, **call)  # (B, H, kept, D)
    else:
        out_local, lse_local = attention(q_kept, k_kept, v_kept, return_lse=True, **call)
        out_global, lse_global, side, segments = _global_part(
            module, patch, hidden_states, q_kept, mask, dropout, backend
        )
        out, _ = merge_partials(out_local, lse_local, out_global, lse_global)
    if padded:  # rows of padding: transformers' values and gradients (module docstring)
        out = nn.functional.pad(out, (0, 0, 0, n - kept))  # rows past ``kept``: padding, set below
        e, i, rows = _padding_rows(module, patch, query, key, value, real,
                                   None if local else side, None if local else segments)
        out = out.transpose(1, 2).index_put((e, i), rows.to(out.dtype)).transpose(1, 2)
    out = module.o(out.transpose(1, 2).reshape(b, n, h * d))
    return out, None


def patch_longt5(
    model: nn.Module,
    *,
    backend: str | None = None,
    process_group: object = None,
    layout: str = "contiguous",
    sync_bias_grads: bool = True,
) -> nn.Module:
    """Make a transformers LongT5 model compute its self-attention with :func:`relbias.attention`.

    The encoder's local attention runs as one windowed call (``window=(local_radius, local_radius)``, the first
    layer's T5 bias, the key padding mask); TGlobal adds a second call over the per-block summary keys with their
    side bias, merged by log-sum-exp; the decoder runs as :func:`relbias.integrations.t5.patch_t5` runs it (module
    docstring; Guo et al. 2022, §3.1). Outputs equal the unpatched model's up to float rounding (float32: max abs
    difference <= 1e-5 in the tests), gradients too, for both encoder types, padded batches, greedy and beam search.
    Attention dropout in training runs on relbias' counter-based mask (the same distribution, another mask);
    ``output_attentions=True`` runs transformers' own encoder attention for that call (weights in its block layout:
    (B, N / (r + 1), H, r + 1, 3 (r + 1) [+ N / g])) and the decoder's as the T5 patch does.

    Args:
        model: a transformers ``LongT5Model``, ``LongT5ForConditionalGeneration`` or ``LongT5EncoderModel``
            (``encoder_attention_type`` "local" or "transient-global"), or a module holding one; patched in place.
        backend: relbias backend for every self-attention layer, or None (default): :func:`relbias.attention`'s
            default ("auto").
        process_group: None (default), or a ``torch.distributed`` process group or 1-D ``DeviceMesh`` over whose
            ranks every sequence is sharded along its length (context parallelism): each rank calls the model with
            its contiguous shard of ``input_ids`` / ``attention_mask`` (and of ``decoder_input_ids`` /
            ``decoder_attention_mask``), cut with :func:`relbias.distributed.shard` (``dim=1``), and gets its shard
            of the outputs, equal to the unsharded patched model's. The encoder's local attention fetches the
            ``local_radius + 1`` keys on either side of the shard from its neighbours (a halo) and TGlobal's
            summaries are summed over the group (:mod:`relbias.integrations.longt5_parallel`); a shard length that
            is not a multiple of the local block length ``local_radius + 1`` (and with TGlobal of
            ``global_block_size``) is refused at the call. The decoder runs as under
            ``patch_t5(process_group=...)`` (context-parallel self-attention, the encoder's states all-gathered
            for cross-attention), with its limits: no ``generate``, no ``output_attentions``, no attention dropout
            in training, no ``labels`` without ``decoder_input_ids``. Gradients: the position-bias tables come back
            summed over the group (see ``sync_bias_grads``), every other parameter's as this rank's part.
        layout: with ``process_group``: "contiguous" (the only one: LongT5's local blocks and global blocks must
            each lie on one rank).
        sync_bias_grads: with ``process_group``: True (default) sums the tables' gradients over the group in
            backward; False leaves each rank its part, like every other parameter's.

    Returns:
        ``model``, patched.

    Raises:
        ImportError: transformers is not installed.
        RuntimeError: a transformers version outside ``SUPPORTED_TRANSFORMERS``.
        TypeError: no LongT5 stack in ``model``.
        ValueError: an unknown backend or ``encoder_attention_type``; a decoder with an attention implementation
            other than "sdpa" / "eager"; ``model`` is, or holds, a model patched already with another backend (or
            either patch has a ``process_group``); a ``layout`` other than "contiguous" with ``process_group``.
        RuntimeError: ``process_group`` without an initialised torch.distributed.

    Warns:
        UserWarning: ``model`` is, or holds, a model patched already with this backend (the same model twice, or a
            wrapper of a patched model): nothing changes (:mod:`relbias.integrations.patches`).
    """
    check_model(model, "patch_longt5")
    check_transformers_version()
    holder = longt5_holder(model)
    if holder is None:
        raise TypeError(f"{type(model).__name__} holds no transformers LongT5 model (no encoder/decoder LongT5Stack)")
    check_backend(backend)
    patched = _patches(model)
    if patched:
        return patched_already(model, patched[0], "patch_longt5", patched[0].state.backend, backend,
                               same=process_group is None and patched[0].state.parallel is None)
    parallel = _context_parallel(process_group, layout, sync_bias_grads)
    encoder, decoder = getattr(holder, "encoder", None), getattr(holder, "decoder", None)
    state = LongT5Patch(backend=backend, kind=None, first=None, local_bias=None, global_bias=None, parallel=parallel)
    if decoder is not None:
        implementation = decoder.config._attn_implementation
        if implementation not in _MASK_IMPLEMENTATIONS:
            raise ValueError(
                f"decoder uses attn_implementation={implementation!r}; patch_longt5 reads the masks of "
                f"{_MASK_IMPLEMENTATIONS}: load the model with attn_implementation='eager'"
            )
    if encoder is not None:
        kind = encoder.config.encoder_attention_type
        if kind not in _ENCODER_TYPES:
            raise ValueError(f"encoder_attention_type must be one of {_ENCODER_TYPES}, got {kind!r}")
        name = "LocalSelfAttention" if kind == "local" else "TransientGlobalSelfAttention"
        attentions = [getattr(block.layer[0], name) for block in encoder.block]
        first = attentions[0]

        def table_bias(table: nn.Parameter) -> T5Bias:
            bias = T5Bias(first.n_heads, num_buckets=first.relative_attention_num_buckets,
                          max_distance=first.relative_attention_max_distance, bidirectional=True, init_std=0.0)
            bias.weight = table
            return bias

        state.kind, state.first = kind, first
        state.local_bias = table_bias(first.relative_attention_bias.weight)
        if kind == "transient-global":
            state.global_bias = table_bias(first.global_relative_attention_bias.weight)
    if decoder is not None:
        attentions_dec = [block.layer[0].SelfAttention for block in decoder.block]
        top = attentions_dec[0]
        bias = T5Bias(top.n_heads, num_buckets=top.relative_attention_num_buckets,
                      max_distance=top.relative_attention_max_distance, bidirectional=False, init_std=0.0)
        bias.weight = top.relative_attention_bias.weight
        state.decoder = _PatchState(backend=backend, configs=[], hooked=[], parallel=parallel)
        install_stack(state.decoder, decoder, attentions_dec, [bias] * len(attentions_dec))
    if encoder is not None:
        forward = _encoder_forward if parallel is None else sharded_encoder_forward
        for module in attentions:
            module.forward = functools.partial(forward, module, state)
            state.layers.append(module)
    if parallel is not None:
        if decoder is not None:
            state.decoder.handles.append(
                decoder.register_forward_pre_hook(_gather_encoder_states(parallel), with_kwargs=True))
            state.decoder.handles.append(model.register_forward_pre_hook(_refuse_labels, with_kwargs=True))
        if hasattr(holder, "generate"):
            holder.generate = _refuse_generate
            state.replaced_generate = True
    setattr(holder, _STATE_ATTR, state)  # on the module it changes: a module holding it, or it alone, sees it
    return model


def _context_parallel(process_group, layout: str, sync_bias_grads: bool) -> _ContextParallel | None:
    """patch_longt5's context-parallel settings, checked; None without a ``process_group``."""
    if process_group is None:
        return None
    if layout != "contiguous":
        raise ValueError(
            f"patch_longt5(process_group=...) shards sequences in the contiguous layout only (LongT5's local and "
            f"global blocks must each lie on one rank; under a window the contiguous layout is balanced), got "
            f"layout={layout!r}"
        )
    group = distributed_group("patch_longt5", "process_group", process_group, sync_bias_grads)
    return _ContextParallel(group, layout, "auto", sync_bias_grads)


def unpatch_longt5(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_longt5`: transformers' own attention again, exactly.

    Args:
        model: a model patched by :func:`patch_longt5`, or a module holding one (every patch inside it is undone).

    Returns:
        ``model``, unpatched.

    Raises:
        ValueError: ``model`` neither is nor holds a model patched by :func:`patch_longt5`.
    """
    patched = _patches(model)
    if not patched:
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch_longt5)")
    for _, holder, state in patched:
        for module in state.layers:
            del module.forward  # transformers' own forward again
        if state.decoder is not None:
            restore(state.decoder)
        if state.replaced_generate:
            del holder.generate
        delattr(holder, _STATE_ATTR)
    return model
