"""Shared test fixtures: a seed per test, one torch thread, small backend tiles and fresh dynamo caches on request;
torch's trace logger
silenced; inductor's cache kept apart per ATEN_CPU_CAPABILITY."""

import logging
import os
import warnings

import pytest
import torch
from torch import nn

import relbias

from relbias.backends import blockwise, flex, structured, toeplitz

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# inductor's cache of generated code (torch 2.13) is keyed without the vector ISA that ATEN_CPU_CAPABILITY selects:
# a run under another capability would load C++ written for another vector width (CppCompileError under "default";
# wrong values, or heap corruption, between AVX2 and AVX-512). A run that sets the capability gets its own cache
# folder next to the usual one (TORCHINDUCTOR_CACHE_DIR, else inductor's default), read when inductor first compiles.
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
if _CAPABILITY:
    _base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not _base:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:  # older torch: the same default, /tmp/torchinductor_<user>
            import getpass
            import tempfile

            _base = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        else:
            _base = default_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{os.path.abspath(_base)}_aten_cpu_capability_{_CAPABILITY}"

# torch's structured trace logger ("torch.__trace") is DEBUG and never propagates, so pytest attaches its capture
# handlers to it directly: every failing test that compiled something (flex) then lists dozens of empty
# "DEBUG torch.__trace" lines. It only matters when TORCH_TRACE names a folder for tlparse; otherwise silence it.
if not os.environ.get("TORCH_TRACE"):
    logging.getLogger("torch.__trace").disabled = True


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the test shapes are tiny, and a second thread mostly waits (tests that need two set it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before and after the test (``pytestmark = pytest.mark.usefixtures(
    "fresh_dynamo")`` in a module of compiled tests), so that no compiled graph or recompile limit carries over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 8 keys (blockwise), 8-query band tiles (structured), 8-query kernel calls and 5 x 5
    gradient tiles (toeplitz), so small inputs span many tiles; FlexAttention eager (same score_mod / mask_mod, no compilation per shape)."""
    monkeypatch.setattr(blockwise, "BLOCK_Q", 8)
    monkeypatch.setattr(blockwise, "BLOCK_K", 8)
    monkeypatch.setattr(structured, "BLOCK_Q", 8)
    monkeypatch.setattr(toeplitz, "BLOCK_Q", 8)
    monkeypatch.setattr(toeplitz, "TILE", 5)
    monkeypatch.setattr(flex, "COMPILE", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention warns that it is unfused
        yield


class _Attend(nn.Module):
    """Reference attention as a module, so that torch.func.functional_call can swap the bias parameters."""

    def __init__(self, bias, is_causal):
        super().__init__()
        self.bias, self.is_causal = bias, is_causal

    def forward(self, q, k, v):
        return relbias.attention(q, k, v, bias=self.bias, is_causal=self.is_causal, backend="reference")


def _bias_gradcheck(bias, q, k, v, *, is_causal, wrt_qkv=False):
    """float64 gradcheck of reference attention w.r.t. every bias parameter (and q, k, v when asked).

    Returns (parameter names, the checked function of the parameters, the parameter copies) so that a test
    can assert which parameters were covered or inspect their gradients; gradcheck raises on a mismatch.
    """
    module = _Attend(bias, is_causal)
    names = [n for n, _ in module.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in module.named_parameters())

    def fn(*ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (q, k, v))

    if wrt_qkv:
        qkv = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        assert torch.autograd.gradcheck(
            lambda q, k, v, *ps: torch.func.functional_call(module, dict(zip(names, ps)), (q, k, v)), (*qkv, *params)
        )
    else:
        assert torch.autograd.gradcheck(fn, params)
    return names, fn, params


@pytest.fixture
def bias_gradcheck():
    """The function :func:`_bias_gradcheck`."""
    return _bias_gradcheck
