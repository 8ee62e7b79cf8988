"""T5-family relative position biases as :class:`relbias.T5Bias` modules, from Hugging Face models or checkpoints.

Where the tables live (Raffel et al. 2020, JMLR 21(140), §2.1; Hugging Face ``modeling_t5`` / ``modeling_umt5``):

* T5, mT5, Flan-T5: one table per stack, ``{encoder,decoder}.block.0.layer.0.SelfAttention.relative_attention_bias``,
  computed in the first layer and shared by every layer of that stack;
* UMT5: one table in every layer, ``{encoder,decoder}.block.{i}.layer.0.SelfAttention.relative_attention_bias``.

Encoder tables are bidirectional, decoder self-attention tables causal (``bidirectional=False``); cross-attention
has no position bias (old checkpoints may hold an unused ``EncDecAttention.relative_attention_bias``: it is ignored,
as Hugging Face ignores it). A table has shape ``(num_buckets, num_heads)``, the layout of ``T5Bias.weight``.

Files: :func:`t5_biases_from_safetensors` reads every table of a checkpoint; :func:`t5_bias_from_file` reads one
table from a state_dict / tensor file or a ``.safetensors`` file (what ``relbias inspect --state`` shows).

Nothing here imports transformers: the model functions read the module tree by attribute names only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..biases.t5 import T5Bias
from .common import HF_INSTALL

__all__ = ["T5Biases", "t5_bias_from_file", "t5_biases_from_model", "t5_biases_from_safetensors", "t5_biases_from_state_dict"]

STACKS = ("encoder", "decoder")

_TABLE_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?)(?P<stack>encoder|decoder)\.block\.(?P<layer>\d+)\.layer\.0\.SelfAttention\."
    r"relative_attention_bias\.weight$"
)
_BLOCK_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<stack>encoder|decoder)\.block\.(?P<layer>\d+)\.")


@dataclass(frozen=True)
class T5Biases:
    """The self-attention position biases of a T5-family model, one entry per layer.

    Attributes:
        encoder: tuple of :class:`relbias.T5Bias` (``bidirectional=True``), one per encoder layer; T5/mT5 repeat
            one module object (one table shared by all layers), UMT5 has a distinct module per layer. Empty when
            the model has no encoder.
        decoder: the same for the decoder's causal self-attention (``bidirectional=False``); empty for encoder-only
            models.
    """

    encoder: tuple[T5Bias, ...]
    decoder: tuple[T5Bias, ...]

    def stack(self, name: str) -> tuple[T5Bias, ...]:
        """The biases of stack ``"encoder"`` or ``"decoder"``.

        Raises:
            ValueError: another name.
        """
        if name not in STACKS:
            raise ValueError(f"stack must be 'encoder' or 'decoder', got {name!r}")
        return getattr(self, name)

    def shared(self, name: str) -> bool:
        """True when every layer of the stack uses one module (T5/mT5), False for per-layer tables (UMT5) or none."""
        biases = self.stack(name)
        return len(biases) > 1 and all(b is biases[0] for b in biases)


def _make_bias(table: torch.Tensor, *, bidirectional: bool, max_distance: int, share: bool, where: str) -> T5Bias:
    """A T5Bias whose ``weight`` is ``table`` itself (``share``) or a detached copy of it."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point():
        got = f"shape {tuple(table.shape)} and dtype {table.dtype}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"{where} has {got}; a T5 table is 2-D float (num_buckets, num_heads)")
    num_buckets, num_heads = table.shape
    # T5Bias draws a random initial table; keep the caller's random stream untouched.
    with torch.random.fork_rng(devices=[]):
        bias = T5Bias(num_heads, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
    if share:
        if not isinstance(table, nn.Parameter):
            raise TypeError(f"{where}: share_weights needs an nn.Parameter, got {type(table).__name__}")
        bias.weight = table
    else:
        bias.weight = nn.Parameter(table.detach().clone())
    return bias


def self_attention_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The self-attention modules of each stack of a T5-family model, in layer order.

    Args:
        model: a T5/mT5/UMT5 ``...Model``, ``...ForConditionalGeneration`` or ``...EncoderModel`` (anything with
            ``encoder`` and/or ``decoder`` stacks of ``block[i].layer[0].SelfAttention``).

    Returns:
        ``{"encoder": [...], "decoder": [...]}`` holding the stacks the model has.

    Raises:
        TypeError: the model has no such stack.
    """
    found: dict[str, list[nn.Module]] = {}
    for name in STACKS:
        stack = getattr(model, name, None)
        blocks = getattr(stack, "block", None)
        if stack is None or blocks is None:
            continue
        try:
            found[name] = [block.layer[0].SelfAttention for block in blocks]
        except (AttributeError, IndexError, TypeError) as exc:
            raise TypeError(
                f"{type(model).__name__}.{name} is not a T5-family stack (block[i].layer[0].SelfAttention): {exc}"
            ) from None
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no T5-family encoder or decoder stack (expected attributes 'encoder' / "
            f"'decoder' with 'block[i].layer[0].SelfAttention'); pass a T5, mT5 or UMT5 model"
        )
    return found


def t5_biases_from_model(model: nn.Module, *, share_weights: bool = False, head_shards: int = 1) -> T5Biases:
    """Build the relbias T5 bias modules of a Hugging Face T5, mT5 or UMT5 model.

    Args:
        model: a transformers ``T5Model``, ``T5ForConditionalGeneration``, ``T5EncoderModel`` or the mT5 / UMT5
            equivalents (any model with T5-family ``encoder`` / ``decoder`` stacks).
        share_weights: False (default): each ``T5Bias.weight`` is a detached copy of the model's table (same dtype
            and device). True: it *is* the model's ``relative_attention_bias.weight`` parameter, so training either
            trains both.
        head_shards: the tensor-parallel group size T (default 1): a layer whose ``n_heads`` is already its rank's
            share H/T of the table's H heads is accepted too.

    Returns:
        :class:`T5Biases`; ``num_heads``, ``num_buckets``, ``max_distance`` are the attention modules'
        (``n_heads``, ``relative_attention_num_buckets``, ``relative_attention_max_distance``), bidirectional for the
        encoder and causal for the decoder.

    Raises:
        TypeError: not a T5-family model.
        ValueError: a stack whose first layer has no table, or whose tables disagree with the layer settings.
    """
    stacks = self_attention_modules(model)
    result: dict[str, tuple[T5Bias, ...]] = {name: () for name in STACKS}
    for name, attentions in stacks.items():
        biases: list[T5Bias] = []
        for layer, attention in enumerate(attentions):
            where = f"{name}.block.{layer}.layer.0.SelfAttention"
            if getattr(attention, "has_relative_attention_bias", False):
                bias = _make_bias(
                    attention.relative_attention_bias.weight,
                    bidirectional=name == "encoder",
                    max_distance=attention.relative_attention_max_distance,
                    share=share_weights,
                    where=where,
                )
                heads = {bias.num_heads, bias.num_heads // head_shards}  # sharded by tensor parallelism, or not yet
                if bias.num_buckets != attention.relative_attention_num_buckets or attention.n_heads not in heads:
                    raise ValueError(
                        f"{where}: table of shape {tuple(bias.weight.shape)} does not match num_buckets="
                        f"{attention.relative_attention_num_buckets}, num_heads={attention.n_heads}"
                    )
                biases.append(bias)
            elif layer == 0:
                raise ValueError(f"{where} has no relative_attention_bias: the first layer of a T5 stack must hold one")
            else:
                biases.append(biases[0])  # T5 / mT5: the first layer's table serves every layer
        result[name] = tuple(biases)
    return T5Biases(**result)


def t5_biases_from_state_dict(state_dict: Mapping[str, torch.Tensor], *, max_distance: int = 128) -> T5Biases:
    """Build the relbias T5 bias modules from a T5-family state dict (tables copied, detached).

    The layout is read from the keys: a table in layer 0 only is T5/mT5 (shared by all layers of the stack); a
    table in every layer is UMT5. The number of layers is the number of ``{stack}.block.{i}.`` indices present.
    Keys may carry a common prefix (e.g. ``"model."``). Cross-attention tables are ignored.

    Args:
        state_dict: mapping from parameter names to tensors, as ``model.state_dict()`` or a safetensors file.
        max_distance: ``relative_attention_max_distance`` of the model's config, tokens (not stored in the weights;
            128 for every released T5, mT5, Flan-T5 and UMT5 checkpoint).

    Returns:
        :class:`T5Biases` with tables of shape (num_buckets, num_heads) as stored (dtype kept).

    Raises:
        ValueError: no table; keys with different prefixes; a stack with tables in some layers but not all (other
            than layer 0 alone); tables of different shapes in one stack; a table that is not 2-D float; invalid
            bucket settings (see :func:`relbias.validate_t5_buckets`).
    """
    tables: dict[str, dict[int, torch.Tensor]] = {name: {} for name in STACKS}
    prefixes = set()
    for key, tensor in state_dict.items():
        match = _TABLE_KEY.match(key)
        if match:
            prefixes.add(match["prefix"])
            tables[match["stack"]][int(match["layer"])] = tensor
    if not prefixes:
        raise ValueError(
            "no T5 relative position table found: expected keys like "
            "'encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight'"
        )
    if len(prefixes) > 1:
        raise ValueError(f"tables found under several prefixes {sorted(prefixes)}; pass one model's state dict")
    (prefix,) = prefixes
    num_layers = {name: 0 for name in STACKS}
    for key in state_dict:
        match = _BLOCK_KEY.match(key)
        if match and match["prefix"] == prefix:
            num_layers[match["stack"]] = max(num_layers[match["stack"]], int(match["layer"]) + 1)
    return _biases_from_tables(tables, num_layers, prefix, max_distance)


def _biases_from_tables(
    tables: dict[str, dict[int, torch.Tensor]], num_layers: dict[str, int], prefix: str, max_distance: int
) -> T5Biases:
    result: dict[str, tuple[T5Bias, ...]] = {name: () for name in STACKS}
    for name in STACKS:
        found = tables[name]
        if not found:
            continue
        layers = sorted(found)
        where = f"{prefix}{name}.block.{{}}.layer.0.SelfAttention.relative_attention_bias.weight"
        shapes = {tuple(t.shape) for t in found.values()}
        if len(shapes) > 1:
            raise ValueError(f"{name}: tables of different shapes {sorted(shapes)} in one stack")
        if layers == [0]:
            bias = _make_bias(
                found[0], bidirectional=name == "encoder", max_distance=max_distance, share=False, where=where.format(0)
            )
            result[name] = (bias,) * num_layers[name]
        elif layers == list(range(num_layers[name])):
            result[name] = tuple(
                _make_bias(
                    found[i], bidirectional=name == "encoder", max_distance=max_distance, share=False,
                    where=where.format(i),
                )
                for i in layers
            )
        else:
            raise ValueError(
                f"{name}: tables in layers {layers} of {num_layers[name]}; expected layer 0 only (T5, mT5) or every "
                f"layer (UMT5)"
            )
    return T5Biases(**result)


def t5_biases_from_safetensors(
    path: str | os.PathLike, *, max_distance: int = 128, device: str | torch.device = "cpu"
) -> T5Biases:
    """Build the relbias T5 bias modules from a ``.safetensors`` checkpoint, reading only the bias tables.

    Uses the safetensors library (``safe_open``): the file's header gives the keys, and only the
    ``relative_attention_bias`` tensors are read, so a large checkpoint is not loaded. A sharded checkpoint is one
    file per call; pass the shard that holds the tables (the ``*.index.json`` ``weight_map`` names it) — the layer
    count then comes from that shard's keys only.

    Args:
        path: a ``model.safetensors`` file written by transformers (``save_pretrained``) or ``safetensors.torch``.
        max_distance: ``relative_attention_max_distance`` from the checkpoint's ``config.json``, tokens (default 128).
        device: where the tables are loaded, default CPU.

    Returns:
        :class:`T5Biases`, as :func:`t5_biases_from_state_dict`.

    Raises:
        ImportError: safetensors is not installed (``pip install 'relbias[hf]'``; in a clone
            ``pip install -e '.[hf]'``).
        FileNotFoundError: no such file.
        ValueError: a file safetensors cannot read; as :func:`t5_biases_from_state_dict`.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no safetensors file at {os.fspath(path)!r}")
    keys, tables = _read_tensors(path, lambda key: bool(_TABLE_KEY.match(key)), device=device)
    return t5_biases_from_state_dict(_with_placeholders(keys, tables), max_distance=max_distance)


def _with_placeholders(keys: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every key: ``tensors`` as read, empty placeholders for the rest (they only count layers)."""
    placeholder = torch.empty(0)
    return {**{key: placeholder for key in keys}, **tensors}


def _read_tensors(
    path: str | os.PathLike, wanted: Callable[[str], bool], *, device: str | torch.device = "cpu"
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Every key of a tensor file and the tensors of the ``wanted`` keys.

    A ``.safetensors`` file is read through its header, loading only the wanted tensors; any other file is
    ``torch.load``-ed (``weights_only=True``) and must hold a state_dict of tensors or one tensor (named
    ``"<tensor>"``).

    Raises:
        ImportError: a ``.safetensors`` file and no safetensors package.
        ValueError: a file that cannot be read as either, or holding something else.
    """
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        try:
            from safetensors import safe_open
        except ImportError as exc:  # pragma: no cover - safetensors is a dependency of the hf extra
            raise ImportError(f"reading .safetensors needs the safetensors package: {HF_INSTALL}") from exc
        try:
            with safe_open(path, framework="pt", device=str(device)) as handle:
                keys = list(handle.keys())
                return keys, {key: handle.get_tensor(key) for key in keys if wanted(key)}
        except Exception as exc:  # safetensors raises its own error type for a damaged file
            raise ValueError(f"could not read {path} as safetensors: {exc}") from None
    try:
        obj = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # pickle / zip errors of a file that is not a state_dict
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"could not read {path} as a PyTorch state_dict: {first_line}") from None
    if isinstance(obj, torch.Tensor):
        obj = {"<tensor>": obj}
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state_dict of tensors or a single tensor")
    return list(obj), {key: value for key, value in obj.items() if wanted(key)}


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(repr(k) for k in keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def t5_bias_from_file(
    path: str | os.PathLike,
    *,
    key: str | None = None,
    stack: str | None = None,
    bidirectional: bool | None = None,
    max_distance: int = 128,
) -> tuple[T5Bias, str]:
    """A :class:`relbias.T5Bias` holding one (num_buckets, num_heads) table from a file.

    Args:
        path: a ``torch.save`` state_dict or tensor (.pt, .bin, ...) or a ``.safetensors`` file (only the tables
            are read from it).
        key: the tensor to read. Default: the Hugging Face table of ``stack`` (T5, mT5, UMT5 layout, as
            :func:`t5_biases_from_state_dict`; layer 0), else the file's only 2-D float tensor.
        stack: "encoder" (default when the file has one) or "decoder", for a Hugging Face file.
        bidirectional: the table's direction; default: the Hugging Face stack's (encoder bidirectional, decoder
            causal), or for ``key`` causal when the name contains "decoder", else bidirectional.
        max_distance: T5 max_distance in tokens (not stored in the weights; 128 for released T5 models).

    Returns:
        ``(bias, where)``: the module (float32 ``weight``, a copy; the random stream is left untouched) and the
        tensor's name in the file (``"<tensor>"`` for a file holding one bare tensor).

    Raises:
        FileNotFoundError: no such file.
        ImportError: a ``.safetensors`` file and no safetensors package.
        ValueError: unreadable file; no such ``key``; no or several candidate tables; a tensor that is not 2-D
            float; a missing stack or a direction contradicting it; invalid bucket settings.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file at {os.fspath(path)!r}")
    if key is None:
        keys, tables = _read_tensors(path, lambda name: bool(_TABLE_KEY.match(name)))
        if tables:
            return _hugging_face_table(path, keys, tables, stack, bidirectional, max_distance)
        keys, tensors = _read_tensors(path, lambda name: True)
        candidates = [k for k, v in tensors.items() if v.dim() == 2 and v.is_floating_point()]
        if len(candidates) != 1:
            raise ValueError(
                f"{os.fspath(path)}: found {len(candidates)} 2-D float tensors ({_some(candidates)}) and no Hugging "
                f"Face T5 table; name the (num_buckets, num_heads) table with key= (relbias inspect: --key)"
            )
        key = candidates[0]
    else:
        keys, tensors = _read_tensors(path, lambda name: name == key)
        if key not in tensors:
            raise ValueError(f"{os.fspath(path)} has no tensor {key!r}; it holds {_some(keys)}")
    if bidirectional is None:
        bidirectional = "decoder" not in key
    bias = _make_bias(tensors[key], bidirectional=bidirectional, max_distance=max_distance, share=False, where=repr(key))
    bias.weight = nn.Parameter(bias.weight.detach().float())
    return bias, key


def _hugging_face_table(
    path: str | os.PathLike,
    keys: list[str],
    tables: dict[str, torch.Tensor],
    stack: str | None,
    bidirectional: bool | None,
    max_distance: int,
) -> tuple[T5Bias, str]:
    """The layer-0 table of ``stack`` among a Hugging Face file's tables, for :func:`t5_bias_from_file`."""
    biases = t5_biases_from_state_dict(_with_placeholders(keys, tables), max_distance=max_distance)
    stack = stack or ("encoder" if biases.encoder else "decoder")
    found = biases.stack(stack)
    if not found:
        raise ValueError(f"{os.fspath(path)} has no {stack} table")
    if bidirectional is not None and bidirectional != (stack == "encoder"):
        raise ValueError(
            f"the {stack} table of a T5 model is {'bidirectional' if stack == 'encoder' else 'causal'}; "
            f"leave bidirectional unset and pick the table with stack= (relbias inspect: drop --causal/--bidirectional, "
            f"use --stack)"
        )
    bias = found[0]
    bias.weight = nn.Parameter(bias.weight.detach().float())
    where = next(k for k in tables if (m := _TABLE_KEY.match(k)) and m["stack"] == stack and m["layer"] == "0")
    return bias, where
