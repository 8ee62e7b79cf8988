"""The backend contract: a backend is one class and one registry line; auto takes the first in priority
order that can run a call; a named backend refuses with its reasons; explain_backend names what runs."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends import BACKENDS, Backend, register_backend, unregister_backend
from relbias.backends.reference import reference_attention


class EvenKeysBackend(Backend):
    """A dummy backend: the reference's math, but only for an even number of keys."""

    name = "even_keys"
    summary = "the reference's math for an even number of keys (a test backend)"

    def unsupported_reasons(self, call):
        return [] if call.alignment.key_len % 2 == 0 else [f"key_len {call.alignment.key_len} is odd"]

    def forward(self, call):
        self.calls = getattr(self, "calls", 0) + 1
        return reference_attention(call)


@pytest.fixture
def dummy(monkeypatch):
    monkeypatch.setattr("relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES", 0)  # no small-block shortcut
    backend = EvenKeysBackend()
    register_backend(backend, before="decode")  # the one registry line: first in priority order
    yield backend
    unregister_backend("even_keys")


def test_a_backend_in_one_class_and_one_registry_line_runs_and_is_chosen_first(dummy):
    assert list(BACKENDS)[0] == "even_keys"
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    bias = relbias.T5Bias(2)
    assert relbias.explain_backend(q, k, v, bias=bias) == (
        "even_keys", f"even_keys: bidirectional, offset-only T5Bias, no mask, no dropout, forward and backward, "
                     f"float32: {dummy.summary}")
    out = relbias.attention(q, k, v, bias=bias)
    assert dummy.calls == 1
    torch.testing.assert_close(out, relbias.attention(q, k, v, bias=bias, backend="reference"))
    # odd key count: the dummy's reason is given when named, and auto falls through to the next backend
    with pytest.raises(ValueError, match="backend 'even_keys' cannot run this call: key_len 5 is odd"):
        relbias.attention(q, k[:, :, :5], v[:, :, :5], bias=bias, backend="even_keys")
    name, reason = relbias.explain_backend(q, k[:, :, :5], v[:, :, :5], bias=bias)
    assert name == "toeplitz" and "not even_keys: key_len 5 is odd" in reason
    assert "not decode: gradients are needed" in reason  # the bias table requires grad


def test_a_backend_must_declare_what_it_cannot_run():
    class Silent(Backend):
        name = "silent"
        summary = "declares nothing"

        def forward(self, call):
            return reference_attention(call)

    with pytest.raises(TypeError, match="abstract"):
        Silent()  # no unsupported_reasons: it cannot be built, let alone registered


def test_registry_refuses_duplicates_reserved_names_and_non_backends():
    with pytest.raises(ValueError, match="'reference' is reserved or already registered"):
        register_backend(type(BACKENDS["reference"])())
    with pytest.raises(TypeError, match="instance of relbias.backends.Backend"):
        register_backend(reference_attention)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        unregister_backend("nope")


def test_priority_order_and_every_backend_keeps_the_contract():
    assert list(BACKENDS) == ["decode", "triton", "flex", "toeplitz", "structured", "blockwise", "reference"]
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    call = relbias.call.make_call(q, k, v, bias=relbias.T5Bias(2), return_lse=True)
    want, want_lse = reference_attention(call)
    for backend in BACKENDS.values():
        assert isinstance(backend.summary, str) and backend.summary
        reasons = backend.unsupported_reasons(call)
        assert isinstance(reasons, list) and all(isinstance(r, str) and len(r) > 10 for r in reasons)
        if reasons or backend.name == "flex":  # flex compiles per shape (its own tests cover it)
            continue
        out, lse = backend.forward(call)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


def test_explain_backend_names_the_backend_that_runs_when_keys_hold_nan(monkeypatch):
    """No hand-offs inside backends: a NaN in a key some query cannot see makes structured refuse, and auto names
    blockwise, which runs; a NaN key every query sees needs no care (it reaches exactly those queries)."""
    monkeypatch.setattr("relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES", 0)
    ran = []
    for name in BACKENDS:
        backend = BACKENDS[name]
        monkeypatch.setattr(backend, "forward", lambda call, f=backend.forward, n=name: ran.append(n) or f(call))
    q, k, v = (torch.randn(1, 2, 40, 4) for _ in range(3))
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16)
    k[0, 1, 7] = float("nan")
    hidden = torch.arange(40) != 7  # key 7 hidden from every query
    name, reason = relbias.explain_backend(q, k, v, bias=bias, mask=hidden)
    assert name == "blockwise" and "not structured: a key or value that some query cannot see holds NaN/inf" in reason
    with torch.no_grad():
        out = relbias.attention(q, k, v, bias=bias, mask=hidden)
        seen = relbias.attention(q, k, v, bias=bias)  # every query sees key 7: toeplitz runs (inference)
    assert ran == ["blockwise", "toeplitz"]
    assert torch.isfinite(out).all()  # the hidden NaN reached nobody
    assert torch.isnan(seen[0, 1]).all() and torch.isfinite(seen[0, 0]).all()  # the seen one reaches its head only


def test_a_backend_without_name_or_summary_is_refused_with_what_it_needs():
    class Nameless(Backend):
        def unsupported_reasons(self, call):
            return []

        def forward(self, call):
            return reference_attention(call)

    with pytest.raises(TypeError, match="Nameless needs a class attribute 'name'"):
        register_backend(Nameless())


def test_auto_does_not_run_checks_of_a_backend_it_passes_over_anyway(monkeypatch):
    """On CPU auto never takes flex: it must not pay flex's one-time compiled probe to find that out."""
    from relbias.backends import flex

    monkeypatch.setattr(flex, "kernel_check", lambda *args: pytest.fail("flex's probe ran for a call auto gives to another"))
    q = torch.randn(1, 8, 1024, 64)
    with torch.no_grad():
        name, reason = relbias.explain_backend(q, q, q, bias=relbias.ALiBiBias(8), is_causal=True)
    assert name == "toeplitz" and "not flex: auto takes flex on CUDA only" in reason
