"""The T5 self-attention layer on relbias, shared by the T5 patch (:mod:`relbias.integrations.t5`) and the LongT5
patch's decoder (:mod:`relbias.integrations.longt5`): the ``"relbias_t5"`` attention function, the position bias a
patched layer hands on (:class:`T5PositionBias`) and the per-stack installation (:func:`install_stack`,
:func:`restore`).

A transformers T5-style attention layer (``T5Attention`` and its copies: mT5, UMT5, Switch Transformers, Pop2Piano,
LongT5's decoder) asks ``compute_bias(query_length, key_length, device, past_seen_tokens)`` for a (1, H, Lq, Lk) bias,
hands it to the next layers, and calls the attention function ``config._attn_implementation`` names. Installed, a
stack's layers get a ``compute_bias`` returning a :class:`T5PositionBias` (the :class:`relbias.T5Bias` and the
positions, no tensor) and a config naming ``"relbias_t5"``, which converts the stack's 4D mask and calls
:func:`relbias.attention` with T5's unscaled scores ``(q . k) + u_{b(i-j)} + Mask`` (Raffel et al. 2020, §2.1).
Nothing here imports a model family's module.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from ..biases.t5 import T5Bias
from ..functional import attention, attention_with_weights
from .compiled_masks import compiled_hf_attention
from .hidden_rows import fill_hidden_rows, fill_hidden_weights, hidden_rows
from .masks import relbias_mask_from_hf
from .t5_tensor_parallel import recipe

__all__ = ["ATTN_IMPLEMENTATION", "T5PositionBias", "install_stack", "relbias_t5_attention", "restore"]

#: Name of the attention function registered with transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "relbias_t5"


@dataclass(frozen=True)
class _ContextParallel:
    """patch_t5's ``process_group``, ``layout`` and ``strategy``: self-attention on sequence shards."""

    group: object  # a torch.distributed ProcessGroup, or None for the default group
    layout: str
    strategy: str
    sync_bias_grads: bool = True


@dataclass
class T5PositionBias:
    """What a patched T5 layer passes where transformers passes its (1, H, Lq, Lk) ``position_bias`` tensor.

    Attributes:
        bias: the :class:`relbias.T5Bias` of the layer (T5/mT5: the stack's first layer's, shared by all layers).
        query_len: Lq, tokens.
        key_len: Lk, tokens (cache included).
        query_start: absolute position of the first query, tokens: transformers' ``past_seen_tokens``; keys start at 0.
            An int, or under ``torch.compile`` the 0-dim int64 tensor a static cache counts its tokens in (kept a
            tensor so that one compiled decoding step serves every position).
        backend: relbias backend name, or None for :func:`relbias.attention`'s default (``"auto"``, which picks a
            backend per call, where relbias has the dispatcher).
        parallel: None, or the process group, layout and strategy of ``patch_t5(..., process_group=)``: the layer's
            tensors are this rank's sequence shard and attention runs context-parallel.
    """

    bias: T5Bias
    query_len: int
    key_len: int
    query_start: int | torch.Tensor
    backend: str | None = None
    parallel: _ContextParallel | None = None
    _mask_cache: list = field(default_factory=list, repr=False)  # [(hf_mask, is_causal, converted)] shared by the stack's layers

    def relbias_mask(self, hf_mask: torch.Tensor | None,
                     is_causal: bool) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
        """``(mask, is_causal, hidden)``: ``relbias_mask_from_hf`` of the stack's mask and its rows with no visible
        key (:func:`~relbias.integrations.hidden_rows.hidden_rows`), computed once per forward and reused by every
        layer."""
        for cached_mask, cached_causal, converted in self._mask_cache:
            if cached_mask is hf_mask and cached_causal == is_causal:
                return converted
        converted = (*relbias_mask_from_hf(hf_mask, is_causal=is_causal, query_start=self.query_start),
                     hidden_rows(hf_mask))
        self._mask_cache[:] = [(hf_mask, is_causal, converted)]
        return converted


@dataclass
class _PatchState:
    """Kept on the patched model (attribute ``_relbias_t5_patch``; the module holding the stacks) so that
    :func:`~relbias.integrations.t5.unpatch_t5` can restore it."""

    backend: str | None
    configs: list  # [(attention module, its original config)]
    hooked: list  # attention modules given an instance-level compute_bias
    parallel: _ContextParallel | None = None
    handles: list = field(default_factory=list)  # forward (pre-)hook handles (context parallelism)
    tensor_parallel: object = None  # patch_t5's tensor_parallel (a group or 1-D mesh; None: every head on every rank)
    sync_bias_grads: bool = True  # under tensor_parallel: the tables' gradients summed over its group
    head_views: dict = field(default_factory=dict, repr=False)  # id(T5Bias) -> its TensorParallelHeads
    replaced_generate: bool = False  # an instance-level generate refusing under context parallelism
    generate_owner: nn.Module | None = None  # the module given that generate (None: the one holding this state)

    def __setstate__(self, state: dict) -> None:
        """Unpickling a patched model (``torch.load``, ``pickle``) registers the attention function its layers name,
        as :func:`~relbias.integrations.t5.patch_t5` did: a process that never called ``patch_t5`` has no ``"relbias_t5"`` in transformers'
        ``AttentionInterface``."""
        self.__dict__.update(state)
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, relbias_t5_attention)


def _compute_bias(attention_module: nn.Module, bias: T5Bias, state: _PatchState, query_length, key_length,
                  device=None, past_seen_tokens=0) -> T5PositionBias:
    """Replacement of ``T5Attention.compute_bias``: the bias module and positions, no tensor.

    ``past_seen_tokens`` is an int, or a 0-dim int64 tensor (``StaticCache``): read as an int in eager mode, kept a
    tensor under ``torch.compile`` (reading it would make the compiled graph depend on its value).
    """
    table = attention_module.relative_attention_bias.weight
    if bias.weight is not table:  # the model's parameter was replaced (e.g. load_state_dict(assign=True))
        bias.weight = table
    if isinstance(past_seen_tokens, torch.Tensor) and torch.compiler.is_compiling():
        query_start = past_seen_tokens
    else:
        query_start = int(past_seen_tokens)
    if state.tensor_parallel is not None:  # this rank's heads of the replicated table
        bias = _rank_heads(state, bias)
    return T5PositionBias(
        bias, int(query_length), int(key_length), query_start=query_start, backend=state.backend,
        parallel=state.parallel,
    )


def _rank_heads(state: _PatchState, bias: T5Bias):
    """The :class:`relbias.distributed.TensorParallelHeads` of ``bias`` for this rank (made once)."""
    view = state.head_views.get(id(bias))
    if view is None or view.parent is not bias:
        from ..distributed.groups import resolve_group
        from ..distributed.tensor_parallel import TensorParallelHeads, rank_heads

        group = resolve_group(state.tensor_parallel, argument="tensor_parallel")
        start, stop = rank_heads(bias.num_heads, group)
        view = TensorParallelHeads(bias, start, stop, group=group, sync_grads=state.sync_bias_grads)
        state.head_views[id(bias)] = view
    return view


def _check_heads(query: torch.Tensor, position_bias: T5PositionBias) -> None:
    """Under ``patch_t5(tensor_parallel=...)``: the layer's query holds this rank's heads."""
    bias = position_bias.bias
    if getattr(bias, "parent", None) is not None and query.shape[1] != bias.num_heads:
        raise ValueError(
            f"patch_t5(tensor_parallel=...) gives this rank heads [{bias.start}, {bias.stop}) of "
            f"{bias.parent.num_heads}, but the layer's query has {query.shape[1]} heads: "
            + recipe(bias.num_heads, query.shape[-1])
        )


def _context_parallel_attention(module, query, key, value, attention_mask, dropout, position_bias, kwargs):
    """Self-attention of a patched layer on this rank's sequence shard (``patch_t5(..., process_group=)``)."""
    from ..distributed import context_parallel_attention

    parallel = position_bias.parallel
    if position_bias.query_start != 0:
        raise NotImplementedError(
            "incremental decoding with a KV cache (generation) is not supported under patch_t5(process_group=...): "
            "the shards of one sequence cannot grow token by token; generate with a model patched without "
            "process_group (the same weights) on one rank"
        )
    if _wants_weights(module, kwargs):
        raise NotImplementedError(
            "output_attentions=True is not supported under patch_t5(process_group=...) (the weights would span every "
            "rank's keys)"
        )
    if module.training and float(dropout) > 0:
        raise NotImplementedError(
            "attention dropout is not supported under patch_t5(process_group=...); set the model's dropout_rate to 0 "
            "or call model.eval()"
        )
    mask, is_causal, _ = position_bias.relbias_mask(attention_mask, bool(getattr(module, "is_causal", False)))
    b, _, local_len, _ = query.shape
    if mask is None:  # every rank passes a mask (a rank whose shard has no padding too), so the ring exchanges alike
        mask = torch.ones(b, 1, 1, local_len, dtype=torch.bool, device=query.device)
    elif mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.dtype != torch.bool:
        raise ValueError(
            "under patch_t5(process_group=...) the attention mask must be a key padding mask (this rank's shard of "
            f"attention_mask, (batch, L/P)), optionally with the causal rule; got a mask of shape {tuple(mask.shape)} "
            "that is neither"
        )
    mask = mask.expand(b, 1, 1, local_len)
    out = context_parallel_attention(
        query, key, value, bias=position_bias.bias, mask=mask, is_causal=is_causal, convention="t5",
        group=parallel.group, layout=parallel.layout, strategy=parallel.strategy,
        sync_bias_grads=parallel.sync_bias_grads,
    )  # (B, H, L/P, D)
    return out.transpose(1, 2).contiguous(), None


def relbias_t5_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_bias: T5PositionBias | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as ``"relbias_t5"``: T5 self-attention through :func:`relbias.attention`.

    Called by transformers' T5 attention layers of a patched model; not meant to be selected with
    ``attn_implementation=`` directly.

    Args:
        module: the T5 attention layer (``is_causal`` tells decoder self-attention).
        query: (B, H, Lq, D); key: (B, H, Lk, D); value: (B, H, Lk, D), the layer's projections (cache included).
        attention_mask: the stack's 4D mask (bool or additive float) or None.
        dropout: attention-probability dropout, applied in training mode (relbias' counter-based mask, generated
            inside the toeplitz backend's native kernels where they run, else by blockwise; the seed comes from
            torch's global RNG, which gradient checkpointing restores for its recomputation).
        scaling: must be 1.0 or None (T5 does not scale scores).
        position_bias: the :class:`T5PositionBias` made by the patched ``compute_bias``.

    Returns:
        (output (B, Lq, H, D) contiguous, weights): weights None, or (B, H, Lq, Lk) attention probabilities when
        transformers records them: ``output_attentions=True`` passed to the call, or set on the model's config
        (materialised by :func:`relbias.attention_with_weights`:
        O(B·H·Lq·Lk) memory; the fast backends run otherwise).

    Raises:
        TypeError: ``position_bias`` is not a :class:`T5PositionBias` (the layer is not patched by :func:`~relbias.integrations.t5.patch_t5`),
            or a mask relbias cannot read.
        ValueError: lengths that disagree with ``position_bias``, or a scale other than 1.
    """
    if not isinstance(position_bias, T5PositionBias):
        raise TypeError(
            f"the '{ATTN_IMPLEMENTATION}' attention needs the relbias position bias that patch_t5 installs, got "
            f"{type(position_bias).__name__}; use relbias.integrations.transformers.patch_t5(model) rather than "
            f"attn_implementation='{ATTN_IMPLEMENTATION}'"
        )
    if scaling not in (None, 1.0):
        raise ValueError(f"T5 attention is unscaled; got scaling={scaling}")
    if (query.shape[2], key.shape[2]) != (position_bias.query_len, position_bias.key_len):
        raise ValueError(
            f"the position bias was made for query_len={position_bias.query_len}, key_len={position_bias.key_len} "
            f"but this layer has {query.shape[2]}, {key.shape[2]}"
        )
    _check_heads(query, position_bias)
    if position_bias.parallel is not None:
        return _context_parallel_attention(module, query, key, value, attention_mask, dropout, position_bias, kwargs)
    causal = bool(getattr(module, "is_causal", False))
    mask, is_causal, hidden = position_bias.relbias_mask(attention_mask, causal)
    call = dict(
        bias=position_bias.bias, mask=mask, is_causal=is_causal, convention="t5",
        query_start=position_bias.query_start, key_start=0,
        dropout_p=float(dropout) if module.training else 0.0,  # transformers passes 0 outside training
    )
    if _wants_weights(module, kwargs):  # asked for: materialised (O(B·H·Lq·Lk)), as transformers' eager path
        _, weights = attention_with_weights(query, key, value, **call)  # (B, H, Lq, Lk), dropout applied
        weights = fill_hidden_weights(weights, hidden)
        out = weights @ value  # (B, H, Lq, D) from the returned weights, as eager: their .grad sees the output
        out = fill_hidden_rows(out, query, key, value, hidden, **_fill(module, position_bias))
        return out.transpose(1, 2).contiguous(), weights
    out = None
    if attention_mask is not None:  # compiled: the mask converted when the graph runs (compiled_masks); else here
        out = compiled_hf_attention(
            query, key, value, attention_mask, bias=position_bias.bias, is_causal=causal,
            query_start=position_bias.query_start, scale=None, convention="t5", backend=position_bias.backend,
            dropout_p=call["dropout_p"])
    if out is None:
        if position_bias.backend is not None:  # else relbias.attention's own default ("auto")
            call["backend"] = position_bias.backend
        out = attention(query, key, value, **call)  # (B, H, Lq, D)
    if hidden is not None:
        out = fill_hidden_rows(out, query, key, value, hidden, **_fill(module, position_bias))
    return out.transpose(1, 2).contiguous(), None  # (B, Lq, H, D), as transformers' attention functions return


def _fill(module: nn.Module, position_bias: T5PositionBias) -> dict:
    """:func:`~relbias.integrations.hidden_rows.fill_hidden_rows`' settings for a T5 layer: rows with no visible key
    get transformers' mean of the values; eager attention adds the mask to the bias, so their gradient reaches the
    table there, while sdpa's torch.where keeps it from the table."""
    eager = getattr(getattr(module, "_relbias_stack_config", None), "_attn_implementation", None) == "eager"
    return dict(scale=1.0, bias=position_bias.bias if eager else None, query_start=position_bias.query_start)


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    """Whether transformers records this layer's attention weights: ``output_attentions`` passed down with the
    call, else the stack's config's (transformers' output recorder reads ``config.output_attentions`` of the stack,
    set before or after patching, without passing it to the attention function)."""
    if kwargs.get("output_attentions") is not None:
        return bool(kwargs["output_attentions"])
    config = getattr(module, "_relbias_stack_config", None) or getattr(module, "config", None)
    return bool(getattr(config, "output_attentions", False))



def install_stack(state: _PatchState, stack: nn.Module, attentions: list[nn.Module], biases) -> None:
    """Point one stack's T5-style self-attention layers at ``"relbias_t5"`` (recorded in ``state``).

    Each layer gets a copy of the stack's config naming the ``"relbias_t5"`` attention function (registered with
    transformers' ``AttentionInterface`` here), and each layer owning a table an instance-level ``compute_bias``
    returning a :class:`T5PositionBias`. :func:`restore` undoes it. Used by :func:`relbias.integrations.t5.patch_t5`
    and by the LongT5 patch for its decoder.

    Args:
        state: the patch's state; its ``configs`` and ``hooked`` lists grow.
        stack: the ``T5Stack`` (or a copy of it, e.g. ``LongT5Stack``) holding the layers.
        attentions: its self-attention modules in layer order (``block[i].layer[0].SelfAttention``).
        biases: one :class:`relbias.T5Bias` per layer, sharing the tables' parameters.
    """
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, relbias_t5_attention)
    patched_config = copy.copy(stack.config)
    patched_config._attn_implementation = ATTN_IMPLEMENTATION
    for module, bias in zip(attentions, biases):
        state.configs.append((module, module.config))
        module.config = patched_config
        module._relbias_stack_config = stack.config  # what transformers' recorder reads
        if module.has_relative_attention_bias:
            module.compute_bias = functools.partial(_compute_bias, module, bias, state)
            state.hooked.append(module)


def restore(state: _PatchState) -> None:
    """Undo :func:`install_stack` (and the hooks of context parallelism) for every layer ``state`` records."""
    for module, config in state.configs:
        module.config = config
        del module._relbias_stack_config
    for module in state.hooked:
        del module.compute_bias  # the instance attribute; the class method shows through again
    for handle in state.handles:
        handle.remove()
