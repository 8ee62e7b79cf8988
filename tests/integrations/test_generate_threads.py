"""One patched model shared by four threads: ``generate`` at different input lengths from each at once gives the
tokens and scores that the same calls give one after another (the same code path, so the same bits), for the T5
patch and for BLOOM (whose patch keeps a per-forward mask conversion on the shared patch state)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

transformers = pytest.importorskip("transformers")

from relbias.integrations.transformers import patch  # noqa: E402

VOCAB = 64


def _bloom():
    return transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2,
                                                                  n_head=6, pad_token_id=0, eos_token_id=1))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))


@pytest.mark.parametrize("build", [_t5, _bloom], ids=["t5", "bloom"])
def test_generate_from_four_threads_equals_sequential_generate(build):
    torch.manual_seed(0)
    model = patch(build().eval())
    generator = torch.Generator().manual_seed(1)
    batches = []
    for length in (9, 20, 33, 47):
        ids = torch.randint(2, VOCAB, (2, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, : length // 3] = 0  # left padding on one row
        batches.append((ids, mask))

    def generate(batch):
        ids, mask = batch
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 num_beams=1, output_scores=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.scores)

    sequential = [generate(batch) for batch in batches]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(generate, batches))
    for (tokens, scores), (want_tokens, want_scores) in zip(concurrent, sequential):
        assert torch.equal(tokens, want_tokens)
        assert torch.equal(scores, want_scores)
