import pytest
import torch

from relbias import T5Bias, t5_bucket


def test_table_layout_and_lookup():
    bias = T5Bias(num_heads=3)
    assert bias.weight.shape == (32, 3) and bias.num_parameters == 96
    out = bias(6, 9, query_start=40, key_start=0)
    offsets = torch.arange(40, 46)[:, None] - torch.arange(0, 9)[None, :]
    expected = bias.weight[t5_bucket(offsets)].permute(2, 0, 1)
    assert torch.equal(out, expected)


def test_initialised_like_hugging_face_t5_small():
    torch.manual_seed(0)
    w = T5Bias(num_heads=64, num_buckets=64).weight
    assert abs(w.std().item() - 512**-0.5) < 0.003 and abs(w.mean().item()) < 0.003


def test_saturation_distance():
    assert T5Bias(2).saturation_distance == 91
    assert T5Bias(2, bidirectional=False).saturation_distance == 113
    bias = T5Bias(2)
    far = bias(1, 400, query_start=1000, key_start=1000 - 91 - 399)  # distances 91+399 .. 91
    assert torch.equal(far, far[..., :1].expand_as(far))


def test_pairs_sharing_a_bucket():
    pairs = T5Bias(1, bidirectional=False).pairs_sharing(40, 20, 64)  # offset 20: bucket 17 = 19..20
    offsets = (pairs[:, 0] - pairs[:, 1]).unique().tolist()
    assert offsets == [19, 20]


def test_bad_settings():
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        T5Bias(0)
    with pytest.raises(ValueError, match="odd num_buckets"):
        T5Bias(4, num_buckets=31)


def test_equal_to_hugging_face_compute_bias():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5", reason="transformers (the dev/hf extra) is not installed")
    from transformers import T5Config

    for is_decoder in (False, True):
        config = T5Config(d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=32, is_decoder=is_decoder)
        hf = t5.T5Attention(config, has_relative_attention_bias=True)
        ours = T5Bias(4, bidirectional=not is_decoder)
        with torch.no_grad():
            ours.weight.copy_(hf.relative_attention_bias.weight)
        # full sequence, and one decoding step after 300 cached tokens (queries aligned to the last key)
        assert torch.equal(ours(200, 200), hf.compute_bias(200, 200)[0])
        assert torch.equal(ours(1, 301), hf.compute_bias(1, 301, past_seen_tokens=300)[0])
