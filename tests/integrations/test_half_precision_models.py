"""Patched T5 models in bfloat16 (``model.to(torch.bfloat16)`` and ``torch.autocast``): outputs within bfloat16's
resolution of transformers' own bfloat16 model and no further from the float32 model than transformers' bfloat16
is; greedy tokens and a training step's gradients as transformers'. transformers' models run its eager attention
(its SDPA path fails in bfloat16 on AMX under ATEN_CPU_CAPABILITY=default, in torch's kernel). On a CPU with AMX-BF16
the attention runs the native kernels in half precision (80 tokens: the packed path), elsewhere on float32 copies."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' / 'dev' extras install it)")

from relbias.integrations.common import check_transformers_version as _check_version  # noqa: E402
from relbias.integrations.transformers import SUPPORTED_TRANSFORMERS, patch_t5  # noqa: E402

try:
    _check_version()
except RuntimeError:
    pytest.skip(f"the installed transformers is outside {SUPPORTED_TRANSFORMERS}", allow_module_level=True)

from ._bfloat16 import EPS, assert_generate_and_training_step_as_transformers  # noqa: E402
from ._bfloat16 import relative_error as _error  # noqa: E402


@pytest.mark.parametrize("autocast", [False, True])
def test_bfloat16_encoder_as_transformers_bfloat16(hf, autocast):
    """Relative max error against the float32 model: patched bfloat16 at most transformers' bfloat16's (+ 2 eps: the
    two round differently), and the two bfloat16 models within a few eps of each other."""
    full = hf.tiny_model("t5", "EncoderModel", attn_implementation="eager")
    plain = hf.tiny_model("t5", "EncoderModel", attn_implementation="eager")
    patched = patch_t5(hf.tiny_model("t5", "EncoderModel"))
    ids, mask = hf.batch(length=80, pad_last=9)
    with torch.no_grad():
        want = full(input_ids=ids, attention_mask=mask).last_hidden_state
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                theirs = plain(input_ids=ids, attention_mask=mask).last_hidden_state
                ours = patched(input_ids=ids, attention_mask=mask).last_hidden_state
        else:
            plain, patched = plain.to(torch.bfloat16), patched.to(torch.bfloat16)
            theirs = plain(input_ids=ids, attention_mask=mask).last_hidden_state
            ours = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    assert ours.dtype == theirs.dtype
    assert _error(ours, want) <= _error(theirs, want) + 2 * EPS
    assert _error(ours, theirs) <= 8 * EPS


def test_bfloat16_generate_and_training_step_as_transformers(hf):
    """Greedy tokens of the bfloat16 models agree where transformers' own bfloat16 and float32 tokens agree; one
    training step's loss and gradient norm within bfloat16's resolution of transformers' bfloat16 model."""
    full = hf.tiny_model("t5", attn_implementation="eager")
    plain = hf.tiny_model("t5", attn_implementation="eager").to(torch.bfloat16)
    patched = patch_t5(hf.tiny_model("t5")).to(torch.bfloat16)
    ids, mask = hf.batch(length=80)
    agree = assert_generate_and_training_step_as_transformers(full, plain, patched, ids, mask, ids[:, :12].contiguous(),
                                                              max_new_tokens=8, min_new_tokens=8)
    assert agree.any()
