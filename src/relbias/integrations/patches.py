"""Where a patch lives, and what ``patch`` / ``unpatch`` do with a model that holds one, or is held by one.

Each family's patch keeps its state on the module it changes (the *holder*: the module whose stacks, layers or
encoder it patches: a ``BloomModel`` inside a ``BloomForCausalLM``, the ``T5EncoderModel`` inside a
``T5ForTokenClassification``, the ``MPNetEncoder`` inside a sentence-transformers model), under one attribute per
family. A module is patched when it or any module inside it holds a state, so that, whatever order a base model and
the head holding it are handed to ``patch`` and ``unpatch`` in:

* patching a model that is, or holds, a patched model changes nothing and says so (a ``UserWarning``), or, where
  it asks for other settings than the patch in place (another backend), raises ``ValueError`` naming the patched
  module and how to repatch it: a second patch is never stacked on a first;
* ``unpatch`` of a model restores every patch inside it, exactly, whichever object was patched (the base or its
  head); a model with no patch inside it raises ``ValueError``.

Models pickled while their state sat on the object handed to ``patch`` are found the same way (that object holds it).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

from torch import nn

from .common import check_model

__all__ = ["Found", "find_patches", "patched_already", "where"]


class Found(NamedTuple):
    """A patch state inside a model: the dotted path of its holder (``""`` for the model itself), the holder, and the
    state."""

    path: str
    holder: nn.Module
    state: object


def find_patches(model: nn.Module, attribute: str, is_state: Callable[[object], bool]) -> list[Found]:
    """Every patch state of one family inside ``model``.

    Args:
        model: any module.
        attribute: the family's state attribute (e.g. ``"_relbias_alibi_patch"``).
        is_state: whether a value of that attribute is the family's state.

    Returns:
        one :class:`Found` per module of ``model.named_modules()`` (``model`` first) holding a state, in that order.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (:func:`relbias.integrations.common.check_model`).
    """
    check_model(model, "relbias' patch, unpatch and is_patched functions")
    return [Found(path, module, module.__dict__[attribute]) for path, module in model.named_modules()
            if is_state(module.__dict__.get(attribute))]


def where(model: nn.Module, found: Found) -> str:
    """How a message names the holder of ``found``: ``"BloomForCausalLM.transformer"``, or the model's class."""
    return type(model).__name__ + (f".{found.path}" if found.path else "")


def patched_already(model: nn.Module, found: Found, family: str, backend: str | None, wanted: str | None,
                    same: bool = True) -> nn.Module:
    """What ``patch`` does when ``model`` is, or holds, a model patched already: nothing, with a ``UserWarning``.

    Args:
        model: the model handed to the patch.
        found: the patch in place inside it (:func:`find_patches`).
        family: the patch function's name, for the messages (e.g. ``"patch_alibi"``).
        backend: the backend of the patch in place; ``wanted``: the backend asked for now.
        same: False where other settings asked for differ from the patch in place (e.g. a process group).

    Returns:
        ``model``, unchanged.

    Raises:
        ValueError: ``wanted`` differs from ``backend``, or ``same`` is False: the patch in place would not be the
            one asked for; the message says to unpatch first.
    """
    holder = where(model, found)
    if wanted != backend or not same:
        raise ValueError(
            f"{holder} is already patched by relbias ({family}, backend={backend!r}); to patch it with other "
            f"settings (backend={wanted!r}) call unpatch({type(model).__name__}) first"
        )
    warnings.warn(
        f"{holder} is already patched by relbias ({family}, backend={backend!r}); patching "
        f"{type(model).__name__} again changes nothing", UserWarning, stacklevel=3,
    )
    return model
