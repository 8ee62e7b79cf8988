"""Models are routinely built on the meta device and loaded afterwards (issue 15, item 4): T5Bias and patch_t5
work inside ``with torch.device("meta")``, and patching under meta then loading the weights equals patching
after loading."""

from __future__ import annotations

import pytest
import torch

import relbias

pytest.importorskip("transformers")

from relbias.integrations.transformers import patch_t5  # noqa: E402


def test_t5_bias_builds_and_evaluates_on_meta():
    with torch.device("meta"):
        bias = relbias.T5Bias(4, num_buckets=8, max_distance=16)
    assert bias.weight.device.type == "meta"
    assert bias(5, 7).shape == (4, 5, 7) and bias(5, 7).device.type == "meta"
    assert relbias.T5Bias(4, num_buckets=8, max_distance=16)(3, 3).device.type == "cpu"  # nothing left behind


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_patch_under_meta_then_load_equals_patch_after_load(hf, family):
    loaded = hf.tiny_model(family)
    want_model = patch_t5(hf.tiny_model(family))
    with torch.device("meta"):
        model = type(loaded)._from_config(loaded.config, attn_implementation="sdpa")
        patch_t5(model)
    model.to_empty(device="cpu")
    model.load_state_dict(loaded.state_dict())
    model.eval()
    input_ids, attention_mask = hf.batch(length=40, pad_last=7)
    decoder_ids, _ = hf.batch(length=12, seed=2)
    with torch.no_grad():
        got = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids).logits
        want = want_model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids).logits
        plain = loaded(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
