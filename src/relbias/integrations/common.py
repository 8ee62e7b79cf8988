"""Helpers shared by the Hugging Face patches (:mod:`relbias.integrations.t5`, ``longt5``, ``mpnet``,
``alibi_decoders`` and the architectures under it): the transformers version check, the backend-name check and the
lookup of a transformers class inside a model.

Nothing here imports another integration module: the patches import this module, and
:mod:`relbias.integrations.transformers` (the ``patch`` / ``unpatch`` front door) imports the patches.
"""

from __future__ import annotations

import importlib
import inspect

from torch import nn

from .. import functional
from ..backends import BACKENDS

__all__ = [
    "SUPPORTED_TRANSFORMERS", "backend_names", "check_backend", "check_model", "check_transformers_version",
    "first_instance",
]

#: Range of transformers versions the patches support, as a pip specifier: the attention-interface / ``cache`` /
#: ``compute_bias(..., past_seen_tokens)`` layout of ``modeling_t5``. Tested with 5.24.0 and 5.25.0.
SUPPORTED_TRANSFORMERS = ">=5.24,<6"

_MIN_VERSION, _MAX_VERSION = (5, 24), (6, 0)
#: How to install the Hugging Face extra, from the package index and from a clone of the repository.
HF_INSTALL = "pip install 'relbias[hf]' (in a clone of the repository: pip install -e '.[hf]')"


def check_transformers_version():
    """Import transformers and check that its version is in :data:`~relbias.integrations.common.SUPPORTED_TRANSFORMERS`.

    Returns:
        the ``transformers`` module.

    Raises:
        ImportError: transformers is not installed (``pip install 'relbias[hf]'``; in a clone
            ``pip install -e '.[hf]'``).
        RuntimeError: the installed version is outside the supported range; the message names both.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"relbias.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS}: {HF_INSTALL}"
        ) from exc
    from packaging.version import Version  # a dependency of transformers

    version = Version(transformers.__version__)
    if not _MIN_VERSION <= version.release[:2] < _MAX_VERSION:
        raise RuntimeError(
            f"transformers {transformers.__version__} is installed, but relbias patches T5 models for transformers"
            f"{SUPPORTED_TRANSFORMERS} only (its T5 attention layout differs); install a supported version"
        )
    return transformers



def backend_names() -> set[str]:
    """Names :func:`relbias.attention` accepts now: the registered backends and its default ("auto" once it exists)."""
    return set(BACKENDS) | {inspect.signature(functional.attention).parameters["backend"].default}


def check_backend(backend: str | None) -> None:
    """Check a patch's ``backend`` argument.

    Args:
        backend: None (:func:`relbias.attention`'s default) or a name it accepts
            (:func:`~relbias.integrations.common.backend_names`).

    Raises:
        ValueError: any other value; the message lists the accepted names.
    """
    if backend is not None and backend not in backend_names():
        raise ValueError(f"unknown backend {backend!r}; available: {sorted(backend_names())} (or None for the default)")


def check_model(model: object, function: str) -> None:
    """Check that ``model``, handed to ``function`` (e.g. ``"patch"``), is a ``torch.nn.Module``.

    Raises:
        TypeError: anything else; a string (a checkpoint's name) is told how to load the model first.
    """
    if isinstance(model, nn.Module):
        return
    hint = "a model object, e.g. from transformers' from_pretrained"
    if isinstance(model, str):
        hint = (f"the model, not its name: load it first, e.g. transformers.AutoModelForSeq2SeqLM.from_pretrained"
                f"({model!r}) or the Auto class of its task, and pass that")
    raise TypeError(f"{function}: expected a torch.nn.Module ({hint}); got {type(model).__name__} {model!r:.80}")


def first_instance(model: nn.Module, modeling: str, class_name: str) -> nn.Module | None:
    """The first module of ``model`` (in ``modules()`` order) that is a ``transformers.models.{modeling}``
    ``class_name`` (e.g. ``"mpnet.modeling_mpnet"``, ``"MPNetEncoder"``), or None (none, or transformers not
    installed)."""
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{modeling}"), class_name)
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, cls)), None)


# The names these helpers had when they lived in relbias.integrations.transformers.
_backend_names, _check_backend, _first_instance = backend_names, check_backend, first_instance
