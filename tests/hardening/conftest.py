"""Fixtures for the hardening tests: one torch thread, small tiles, eager FlexAttention."""

from __future__ import annotations

import warnings

import pytest
import torch

from relbias.backends import blockwise, flex, structured

#: Every registered backend; the tests iterate over these names.
BACKEND_NAMES = ["reference", "blockwise", "structured", "flex"]


