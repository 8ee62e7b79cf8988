"""Fixtures for the hardening tests: one torch thread, small tiles, eager FlexAttention."""

from __future__ import annotations

import warnings

import pytest
import torch

from relbias.backends import BACKENDS, blockwise, flex, structured

from .._markers import triton_runs_on_cpu

#: Every registered backend (from the registry, in priority order); the tests iterate over these names.
BACKEND_NAMES = [name for name in BACKENDS if name != "triton" or triton_runs_on_cpu()]


