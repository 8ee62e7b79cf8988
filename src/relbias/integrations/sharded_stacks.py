"""What a context-parallel encoder-decoder patch (``patch_t5`` / ``patch_longt5`` with ``process_group``) adds
around its stacks: the check of its settings, the decoder's pre-hook that all-gathers the encoder's states for
cross-attention, and the refusals of what cannot run on sequence shards (labels shifted shard by shard,
``generate``)."""

from __future__ import annotations

from .t5_attention import _ContextParallel

__all__ = []


def distributed_group(patch: str, argument: str, group: object, sync_bias_grads: object):
    """The process group ``group`` names for ``patch(..., argument=group)`` (``resolve_group``), after checking that
    torch.distributed is initialised and ``sync_bias_grads`` is a bool.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: a non-bool ``sync_bias_grads``; ``group`` neither a process group, a 1-D DeviceMesh nor None.
        ValueError: a DeviceMesh of more than one dimension.
    """
    import torch.distributed as dist

    from ..distributed.groups import resolve_group

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{patch}({argument}=...) needs an initialised torch.distributed process group")
    if not isinstance(sync_bias_grads, bool):
        raise TypeError(f"sync_bias_grads must be a bool, got {sync_bias_grads!r}")
    return resolve_group(group, argument=argument)


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
