"""Fixtures for the hardening tests: one torch thread, small tiles, eager FlexAttention."""

from __future__ import annotations

import warnings

import pytest
import torch

from relbias.backends import BACKENDS, blockwise, flex, structured

#: Every registered backend (from the registry, in priority order); the tests iterate over these names.
BACKEND_NAMES = list(BACKENDS)


