"""Hugging Face 4D attention masks turned into what :func:`relbias.attention` takes.

transformers builds one mask per stack (``masking_utils.create_bidirectional_mask`` / ``create_causal_mask``) of
shape (B, 1, Lq, Lk): bool (True = may attend) for "sdpa", additive float (0 or ``finfo(dtype).min``) for "eager",
or None when there is nothing to mask. Most such masks are a key padding mask, optionally combined with the causal
rule; relbias takes that as a (B, 1, 1, Lk) bool mask plus ``is_causal``, which a memory-efficient backend can read
without a (Lq, Lk) tensor. Anything else is passed on whole, as an exact mask.

Deciding which form a mask has reads its values, so under ``torch.compile`` the conversion passes the mask on whole
instead: still exact, as transformers' masks of causal attention contain the causal rule. Compiled calls of the
patches convert it when the graph runs instead (:mod:`relbias.integrations.compiled_masks`); the whole mask serves a
static cache's compiled decoding steps.
"""

from __future__ import annotations

import torch

from ..positions import resolve_alignment

__all__ = ["dense_key_bias", "hf_visible", "keys_in_one_run", "offsets_count_positions", "relbias_mask_from_hf"]


def hf_visible(mask: torch.Tensor) -> torch.Tensor:
    """Which keys a transformers 4-D mask lets each query see: bool, same shape (True = may attend). A float mask
    hides a key with a value ``<= finfo(dtype).min / 2`` (transformers writes ``finfo(dtype).min``) or -inf."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def keys_in_one_run(key_padding: torch.Tensor, end: int) -> bool:
    """Whether each row's visible keys among the first ``end`` form one run (pads only before and after), for a bool
    key padding mask (B, 1, 1, Lk), True = may attend. Positions counted over visible tokens (BLOOM's, Falcon's) then
    differ from the offsets by one constant per row."""
    visible = key_padding.reshape(key_padding.shape[0], -1)[:, :end]
    rises = (visible[:, 1:] & ~visible[:, :-1]).sum(dim=1) + visible[:, 0].long()
    return bool((rises <= 1).all())


def offsets_count_positions(mask: torch.Tensor | None, is_causal: bool, end: int, *, read_values: bool = True) -> bool:
    """Whether a model that counts positions over visible tokens (BLOOM, Falcon) may have its bias read per offset:
    under the causal rule, with no mask or a bool key padding mask (B, 1, 1, Lk) whose visible keys among the first
    ``end`` form one run in each row (:func:`keys_in_one_run`; positions and offsets then differ by one constant per
    row, which softmax ignores). ``(mask, is_causal)`` as :func:`relbias_mask_from_hf` returns them. With
    ``read_values=False`` (a compiled graph, which cannot branch on values) only the mask-free case counts. Otherwise
    the model's own per-key bias runs, dense with the mask (:func:`dense_key_bias`)."""
    return is_causal and (mask is None or (read_values and keys_in_one_run(mask, end)))


def dense_key_bias(key_bias: torch.Tensor, hf_mask: torch.Tensor) -> torch.Tensor:
    """A model's own per-key bias (B, H, 1, Lk), logits after scaling, with transformers' 4-D mask (B, 1, Lq, Lk)
    folded in: float (B, H, Lq, Lk), -inf where a key is hidden, as relbias' additive ``mask`` (used when the offsets
    do not stand for the model's positions, :func:`offsets_count_positions`)."""
    return key_bias.masked_fill(~hf_visible(hf_mask), float("-inf"))


def relbias_mask_from_hf(
    mask: torch.Tensor | None, *, is_causal: bool, query_start: int | torch.Tensor = 0
) -> tuple[torch.Tensor | None, bool]:
    """Convert a transformers attention mask into ``(mask, is_causal)`` for :func:`relbias.attention`.

    Args:
        mask: None; bool (B, 1, Lq, Lk), True = may attend; or float (B, 1, Lq, Lk), additive, where values
            ``<= finfo(dtype).min / 2`` (transformers writes ``finfo(dtype).min``) or -inf hide a key.
        is_causal: whether the attention is causal (decoder self-attention). For a causal attention the mask is
            expected to contain the causal rule already, as transformers builds it.
        query_start: absolute position (tokens) of the first query, keys starting at 0: the number of tokens
            already in the cache (transformers' ``past_seen_tokens``), an int or a 0-dim integer tensor (a static
            cache's count; read once in eager mode, never read under ``torch.compile``).

    Returns:
        ``(mask, is_causal)``:

        * ``(None, is_causal)`` when the mask hides nothing beyond the causal rule;
        * ``(key_padding, is_causal)`` with ``key_padding`` bool (B, 1, 1, Lk) when the mask is exactly a key padding
          mask (bidirectional) or a key padding mask and the causal rule for queries at ``query_start ...``;
        * otherwise ``(exact, False)``: a bool (B, 1, Lq, Lk) mask, or, for a float mask with other finite values, the
          float mask with hidden entries set to -inf.

        Under ``torch.compile`` (where each of these tests would read the mask's values) always the last form: the
        bool mask as it is, or the float mask with hidden entries (``<= finfo.min / 2``) set to -inf.

        A hidden key gets exactly zero weight either way. A query row with no visible key returns zeros in relbias,
        where transformers' finite fill returns the mean of the values (such rows are padding): the patches find
        those rows with :func:`relbias.integrations.hidden_rows.hidden_rows` and give them transformers' result.

    Raises:
        TypeError: a mask that is not a tensor (e.g. a flex-attention ``BlockMask``) or of an integer dtype.
        ValueError: a mask that is not 4-D.
    """
    if mask is None:
        return None, is_causal
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"cannot convert a {type(mask).__name__} attention mask; relbias patches models whose attention "
            f"implementation is 'sdpa' or 'eager' (bool or additive float 4D masks)"
        )
    if mask.dim() != 4:
        raise ValueError(f"expected a 4D attention mask (batch, 1, query_len, key_len), got shape {tuple(mask.shape)}")
    if not mask.is_floating_point() and mask.dtype != torch.bool:
        raise TypeError(f"an attention mask must be bool or float, got {mask.dtype}")
    compiling = torch.compiler.is_compiling()  # no value-dependent simplification: the exact mask, whole
    visible = hf_visible(mask)
    if mask.is_floating_point():
        hidden = ~visible  # also true for -inf
        if compiling or bool(mask.masked_fill(hidden, 0.0).any()):  # finite values other than 0: a real additive mask
            return mask.masked_fill(hidden, float("-inf")), False
    if compiling:
        return visible, False
    if visible.shape[1] != 1:
        return visible, False

    query_len, key_len = visible.shape[-2:]
    if not is_causal:
        # Every query sees the same keys exactly when, per key, "all queries" equals "any query".
        key_padding = visible.any(dim=2, keepdim=True)  # (B, 1, 1, Lk)
        if not torch.equal(visible.all(dim=2, keepdim=True), key_padding):
            return visible, False
        return (None if bool(key_padding.all()) else key_padding), False

    alignment = resolve_alignment(query_len, key_len, query_start=query_start)  # a tensor query_start read here
    query_start = alignment.query_start
    if query_len == 1 and query_start >= key_len - 1:  # a decoding step: the causal rule hides no key, the row is
        return (None if bool(visible.all()) else visible), True  # the key padding mask (one reduction, no scans)
    causal = alignment.offsets(visible.device) >= 0  # (Lq, Lk)
    key_padding = visible.any(dim=2, keepdim=True)  # (B, 1, 1, Lk); keys no query may see are hidden anyway
    if not torch.equal(visible, causal & key_padding):
        return visible, False
    # Keys after the last query are hidden by the causal rule; only the others decide whether padding remains.
    last_visible_key = min(key_len, query_start + query_len)
    if bool(key_padding[..., : max(last_visible_key, 0)].all()):
        return None, True
    return key_padding, True
