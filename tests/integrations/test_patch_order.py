"""patch / unpatch over a base model and the head holding it, in any order: a second patch is never stacked on a
first, unpatch restores transformers exactly whichever object it is handed, and no sequence of calls leaves a model
whose outputs differ from transformers' without an error.

Hypothesis drives random sequences of ``patch`` / ``unpatch`` (each on the head or its base model, ``patch`` with the
default backend or another) for every family, checking after every call the outputs against the unpatched model's,
the patched state against a model of the rules, and at the end that unpatching leaves transformers' outputs bit for
bit and no attribute behind."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from relbias.integrations import alibi_decoders, longt5, mpnet, t5  # noqa: E402
from relbias.integrations.transformers import patch, unpatch  # noqa: E402

VOCAB = 64


class _Holder(torch.nn.Module):
    """A user's module holding a model (LongT5 has no head holding a base model)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner


def _t5_config():
    return transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                 dropout_rate=0.0, pad_token_id=0, num_labels=3)


def _longt5():
    config = transformers.LongT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                       local_radius=5, global_block_size=4, dropout_rate=0.0, pad_token_id=0,
                                       encoder_attention_type="transient-global")
    return _Holder(transformers.LongT5EncoderModel(config))


#: family -> (build the head, its base model, the output compared, the family's is_patched)
FAMILIES = {
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6)), lambda m: m.transformer,
        lambda m, ids: m(ids).logits, alibi_decoders.is_alibi_patched),
    "mpt": (lambda: transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6, max_seq_len=64)), lambda m: m.transformer,
        lambda m, ids: m(ids).logits, alibi_decoders.is_alibi_patched),
    "falcon": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, bias=True)),
        lambda m: m.transformer, lambda m, ids: m(ids).logits, alibi_decoders.is_alibi_patched),
    "mpnet": (lambda: transformers.MPNetForMaskedLM(transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)),
        lambda m: m.mpnet, lambda m, ids: m(ids).logits, mpnet.is_mpnet_patched),
    "t5": (lambda: transformers.T5ForTokenClassification(_t5_config()), lambda m: m.transformer,
           lambda m, ids: m(ids).logits, t5.is_patched),
    "longt5": (_longt5, lambda m: m.inner, lambda m, ids: m.inner(ids).last_hidden_state,
               longt5.is_longt5_patched),
}
#: A call: (function, "head" or "base", backend asked for by patch).
CALLS = st.tuples(st.sampled_from(["patch", "unpatch"]), st.sampled_from(["head", "base"]),
                  st.sampled_from([None, None, "reference"]))
#: The sequence the bug reports: a hook patching every model built (the base, then the head), then one unpatch.
HOOK_ORDER = [("patch", "base", None), ("patch", "head", None), ("unpatch", "head", None)]

_PRISTINE: dict = {}


def _pristine(family: str):
    """(head, outputs) of the unpatched model, built once per family."""
    if family not in _PRISTINE:
        build, _, run, _ = FAMILIES[family]
        torch.manual_seed(0)
        head = build().eval()
        ids = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _PRISTINE[family] = head, ids, run(head, ids)
    return _PRISTINE[family]


def _attributes(model: torch.nn.Module) -> dict:
    """Each module's instance attribute names: what a patch adds and unpatch must take away again."""
    return {path: sorted(module.__dict__) for path, module in model.named_modules()}


def _call(head, base, call, patched_backend):
    """Run one call, check its outcome against the rules; the backend patched after it (``False``: unpatched)."""
    function, target, backend = call
    model = head if target == "head" else base
    if function == "unpatch":
        if patched_backend is False:
            with pytest.raises(ValueError, match="not patched by relbias"):
                unpatch(model)
            return False
        assert unpatch(model) is model
        return False
    if patched_backend is False:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a first patch says nothing
            assert patch(model, backend=backend) is model
        return backend
    if backend != patched_backend:
        with pytest.raises(ValueError, match="already patched by relbias .* call unpatch"):
            patch(model, backend=backend)
    else:
        with pytest.warns(UserWarning, match="already patched by relbias .* changes nothing"):
            assert patch(model, backend=backend) is model
    return patched_backend


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(calls=st.lists(CALLS, min_size=1, max_size=6))
@example(calls=HOOK_ORDER)
@example(calls=[("patch", "head", None), ("patch", "base", None), ("unpatch", "base", None), ("unpatch", "head", None)])
def test_any_order_of_patch_and_unpatch_keeps_transformers_outputs(family, calls):
    pristine, ids, want = _pristine(family)
    _, base_of, run, is_patched = FAMILIES[family]
    head = copy.deepcopy(pristine)
    base = base_of(head)
    patched_backend = False
    for call in calls:
        patched_backend = _call(head, base, call, patched_backend)
        assert is_patched(head) == (patched_backend is not False)
        assert is_patched(base) == (patched_backend is not False)  # the patch lives on the model it changes
        with torch.no_grad():
            torch.testing.assert_close(run(head, ids), want, rtol=1e-5, atol=1e-5)
    if patched_backend is not False:
        unpatch(head if len(calls) % 2 else base)
    with torch.no_grad():
        assert torch.equal(run(head, ids), want)  # transformers' own code again: the same bits
    assert _attributes(head) == _attributes(pristine)
