"""The T5 patch: Hugging Face T5-family models (T5, mT5, Flan-T5, UMT5, Switch Transformers, Pop2Piano) with relbias
attention.

``patch_t5(model)`` makes the self-attention of every encoder and decoder layer compute
``softmax((q . k) + u_{b(i-j)} + Mask) v`` (T5's unscaled scores, Raffel et al. 2020, JMLR 21(140), §2.1) with
:func:`relbias.attention`, reading the model's own ``relative_attention_bias`` table through a
:class:`relbias.T5Bias` that shares its parameter. ``unpatch_t5(model)`` undoes it exactly.

How (transformers >= 5.24, < 6): each T5 attention layer asks ``compute_bias(query_length, key_length, device,
past_seen_tokens)`` for a (1, H, Lq, Lk) bias, hands it to the next layers, and calls the attention function that
``config._attn_implementation`` names. The patch

* replaces ``compute_bias`` on the layers that own a table by one returning a :class:`T5PositionBias` (the
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

import copy
import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..biases.t5 import T5Bias
from ..functional import attention, attention_with_weights
from .common import SUPPORTED_TRANSFORMERS, check_backend, check_transformers_version
from .hidden_rows import fill_hidden_rows, fill_hidden_weights, hidden_rows
from .loading import self_attention_modules, t5_biases_from_model
from .masks import relbias_mask_from_hf

__all__ = [
    "ATTN_IMPLEMENTATION", "T5PositionBias", "install_stack", "is_patched", "patch_t5", "relbias_t5_attention",
    "restore", "t5_stacks", "unpatch_t5",
]

#: Name of the attention function registered with transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "relbias_t5"

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
    """Kept on a patched model (attribute ``_relbias_t5_patch``) so that :func:`unpatch_t5` can restore it."""

    backend: str | None
    configs: list  # [(attention module, its original config)]
    hooked: list  # attention modules given an instance-level compute_bias
    parallel: _ContextParallel | None = None
    handles: list = field(default_factory=list)  # forward (pre-)hook handles (context parallelism)
    replaced_generate: bool = False  # an instance-level generate refusing under context parallelism

    def __setstate__(self, state: dict) -> None:
        """Unpickling a patched model (``torch.load``, ``pickle``) registers the attention function its layers name,
        as :func:`patch_t5` did: a process that never called ``patch_t5`` has no ``"relbias_t5"`` in transformers'
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
    return T5PositionBias(
        bias, int(query_length), int(key_length), query_start=query_start, backend=state.backend,
        parallel=state.parallel,
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
        TypeError: ``position_bias`` is not a :class:`T5PositionBias` (the layer is not patched by :func:`patch_t5`),
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
    if position_bias.parallel is not None:
        return _context_parallel_attention(module, query, key, value, attention_mask, dropout, position_bias, kwargs)
    mask, is_causal, hidden = position_bias.relbias_mask(attention_mask, bool(getattr(module, "is_causal", False)))
    call = dict(
        bias=position_bias.bias, mask=mask, is_causal=is_causal, convention="t5",
        query_start=position_bias.query_start, key_start=0,
        dropout_p=float(dropout) if module.training else 0.0,  # transformers passes 0 outside training
    )
    # Rows with no visible key get transformers' mean of the values; eager attention adds the mask to the bias, so
    # their gradient reaches the table there, while sdpa's torch.where keeps it from the table.
    eager = getattr(getattr(module, "_relbias_stack_config", None), "_attn_implementation", None) == "eager"
    fill = dict(scale=1.0, bias=position_bias.bias if eager else None, query_start=position_bias.query_start)
    if _wants_weights(module, kwargs):  # asked for: materialised (O(B·H·Lq·Lk)), as transformers' eager path
        _, weights = attention_with_weights(query, key, value, **call)  # (B, H, Lq, Lk), dropout applied
        weights = fill_hidden_weights(weights, hidden)
        out = weights @ value  # (B, H, Lq, D) from the returned weights, as eager: their .grad sees the output
        out = fill_hidden_rows(out, query, key, value, hidden, **fill)
        return out.transpose(1, 2).contiguous(), weights
    # No backend given: relbias.attention's own default ("auto" where relbias has the dispatcher).
    backend = {} if position_bias.backend is None else {"backend": position_bias.backend}
    out = attention(query, key, value, **call, **backend)  # (B, H, Lq, D)
    out = fill_hidden_rows(out, query, key, value, hidden, **fill)
    return out.transpose(1, 2).contiguous(), None  # (B, Lq, H, D), as transformers' attention functions return


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    """Whether transformers records this layer's attention weights: ``output_attentions`` passed down with the
    call, else the stack's config's (transformers' output recorder reads ``config.output_attentions`` of the stack,
    set before or after patching, without passing it to the attention function)."""
    if kwargs.get("output_attentions") is not None:
        return bool(kwargs["output_attentions"])
    config = getattr(module, "_relbias_stack_config", None) or getattr(module, "config", None)
    return bool(getattr(config, "output_attentions", False))


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


def is_patched(model: nn.Module) -> bool:
    """True when :func:`patch_t5` (or :func:`relbias.integrations.transformers.patch`) has patched ``model`` and
    :func:`unpatch_t5` has not undone it; for LongT5, :func:`relbias.integrations.longt5.is_longt5_patched`; for
    MPNet, :func:`relbias.integrations.mpnet.is_mpnet_patched`; for the ALiBi decoders,
    :func:`relbias.integrations.alibi_decoders.is_alibi_patched`."""
    return isinstance(getattr(model, _STATE_ATTR, None), _PatchState)


def _gather_encoder_states(parallel: _ContextParallel):
    """A forward pre-hook of the decoder stack: the encoder's hidden states and attention mask, sharded along the
    sequence, all-gathered into the full memory (differentiable) before cross-attention reads them."""
    from ..distributed import gather_sequence

    def hook(module, args, kwargs):
        states = kwargs.get("encoder_hidden_states")
        if states is None:
            return None
        kwargs = dict(kwargs)
        kwargs["encoder_hidden_states"] = gather_sequence(states, dim=1, group=parallel.group, layout=parallel.layout)
        mask = kwargs.get("encoder_attention_mask")
        if mask is not None:
            kwargs["encoder_attention_mask"] = gather_sequence(mask, dim=1, group=parallel.group, layout=parallel.layout)
        return args, kwargs

    return hook


def _refuse_labels(module, args, kwargs):
    """A forward pre-hook of the seq2seq model: labels would be shifted right shard by shard (wrong)."""
    if kwargs.get("labels") is not None and kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
        raise ValueError(
            "under patch_t5(process_group=...) pass decoder_input_ids (the full labels shifted right with "
            "model._shift_right, then sharded) rather than labels alone: shifting each shard right is wrong"
        )
    return None


def _refuse_generate(*args, **kwargs):
    raise NotImplementedError(
        "generate() is not supported under patch_t5(process_group=...): incremental decoding with a KV cache cannot "
        "run on sequence shards; unpatch_t5(model) and patch_t5(model) without process_group, or generate with a "
        "copy of the model on one rank"
    )


def patch_t5(
    model: nn.Module,
    *,
    backend: str | None = None,
    process_group: object = None,
    layout: str = "contiguous",
    strategy: str = "ring",
    sync_bias_grads: bool = True,
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
        strategy: with ``process_group``: "ring" (default) or "ulysses" (needs num_heads % P == 0).
        sync_bias_grads: with ``process_group``: True (default) sums the ``relative_attention_bias`` gradients over
            the group in backward; False leaves each rank its part, like every other parameter's, for a
            data-parallel wrapper that reduces over the group's ranks too (FSDP2 over a flattened data x context
            mesh; see :func:`relbias.distributed.context_parallel_attention`).

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
        ValueError: the model is already patched; an attention implementation other than "sdpa" / "eager"; an
            unknown backend; a DeviceMesh of more than one dimension as ``process_group``.
    """
    check_transformers_version()
    holder, attention_cls = _stack_holder(model)
    _check_layout(attention_cls)
    if is_patched(model):
        raise ValueError(f"this {type(model).__name__} is already patched; call unpatch_t5(model) first")
    check_backend(backend)
    parallel = None
    if process_group is not None:
        import torch.distributed as dist

        from ..distributed.groups import resolve_group
        from ..distributed.layout import check_layout
        from ..distributed.validate import STRATEGIES

        check_layout(layout)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("patch_t5(process_group=...) needs an initialised torch.distributed process group")
        if not isinstance(sync_bias_grads, bool):
            raise TypeError(f"sync_bias_grads must be a bool, got {sync_bias_grads!r}")
        group = resolve_group(process_group, argument="process_group")
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

    biases = t5_biases_from_model(holder, share_weights=True)
    state = _PatchState(backend=backend, configs=[], hooked=[], parallel=parallel)
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
    setattr(model, _STATE_ATTR, state)
    return model


def install_stack(state: _PatchState, stack: nn.Module, attentions: list[nn.Module], biases) -> None:
    """Point one stack's T5-style self-attention layers at ``"relbias_t5"`` (recorded in ``state``).

    Each layer gets a copy of the stack's config naming the ``"relbias_t5"`` attention function (registered with
    transformers' ``AttentionInterface`` here), and each layer owning a table an instance-level ``compute_bias``
    returning a :class:`T5PositionBias`. :func:`restore` undoes it. Used by :func:`patch_t5` and by the LongT5
    patch for its decoder.

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


def unpatch_t5(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_t5`: restore every attention layer's config and ``compute_bias`` exactly.

    Args:
        model: a model patched by :func:`patch_t5`.

    Returns:
        ``model``, computing attention with transformers' own code again.

    Raises:
        ValueError: the model is not patched.
    """
    state = getattr(model, _STATE_ATTR, None)
    if not isinstance(state, _PatchState):
        raise ValueError(f"this {type(model).__name__} is not patched by relbias (patch_t5)")
    restore(state)
    if state.replaced_generate:
        del model.generate
    delattr(model, _STATE_ATTR)
    return model
