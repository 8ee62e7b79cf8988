"""Attention backends behind one contract (:class:`Backend`), registered in priority order
(:data:`BACKENDS`); ``backend="auto"`` (``relbias.dispatch``) chooses among them per call."""

from .base import Backend
from .registry import BACKENDS, register_backend, unregister_backend

__all__ = ["BACKENDS", "Backend", "register_backend", "unregister_backend"]
