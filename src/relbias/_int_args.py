"""Argument checks shared by constructors and functions (no relbias imports, so any module may use it)."""

from __future__ import annotations


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (bools rejected) and at least ``minimum``.

    Raises:
        TypeError: ``value`` is not an int, or is a bool.
        ValueError: ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
