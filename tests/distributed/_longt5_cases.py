"""Cases of the multi-process LongT5 tests: ``patch_longt5(model, process_group=...)`` on every rank against the
unsharded single-process patched model (outputs and every parameter's gradient), and its refusals. Shared by
test_longt5_cp.py (names) and _longt5_worker.py (running them)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relbias.distributed import shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare import excess, grad_errors, seq2seq_step  # noqa: E402

VOCAB, BATCH = 64, 4


@dataclass(frozen=True)
class LongT5Case:
    name: str
    kind: str  # "local" or "transient-global"
    model: str = "ForConditionalGeneration"
    length: int = 96  # a multiple of 12 x P: local blocks of 6, global blocks of 4, whole on every rank
    sync_bias_grads: bool = True


CASES = [
    LongT5Case("local-seq2seq", "local"),
    LongT5Case("tglobal-seq2seq", "transient-global"),
    LongT5Case("tglobal-encoder", "transient-global", model="EncoderModel"),
    LongT5Case("local-encoder-unsynced", "local", model="EncoderModel", sync_bias_grads=False),
    # radius 13 (blocks of 14) and 224-token sequences: on 4 ranks a shard of 56 is four blocks
    LongT5Case("tglobal-encoder-radius13", "transient-global", model="EncoderModel", length=224),
]

#: refusal name -> (exception type name, substring of the message)
REFUSALS = {
    "shard_cuts_a_block": ("ValueError", "must be a multiple of the local block length"),
    "zigzag_layout": ("ValueError", "contiguous layout only"),
    "generate": ("NotImplementedError", "generate() is not supported"),
    "dropout_in_training": ("NotImplementedError", "attention dropout is not supported"),
}


def make_model(case: LongT5Case, **overrides):
    """The tiny LongT5 of tests/integrations/test_longt5.py (2 layers, 4 heads, blocks of 6, summaries of 4, tables
    scaled x10 so that they weigh as much as q.k), seeded: the same weights in every process."""
    import transformers

    radius = 13 if case.name.endswith("radius13") else 5
    settings = dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, local_radius=radius,
        global_block_size=4, encoder_attention_type=case.kind, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, f"LongT5{case.model}")(transformers.LongT5Config(**settings)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "relative_attention_bias" in name:
                parameter.mul_(10.0)
    return model


def make_batch(length: int):
    """Rows: full, right padding over half the sequence (every later rank's shard all padding), one padded token,
    left padding of 5."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(2, VOCAB, (BATCH, length), generator=g)
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, length // 2:] = 0
    mask[2, length - 1:] = 0
    mask[3, :5] = 0
    return ids, mask


def applies(case: LongT5Case, world_size: int) -> bool:
    """Every case runs on every group size."""
    return True


def run_case(case: LongT5Case, rank: int, world_size: int) -> dict:
    from relbias.integrations.longt5 import patch_longt5

    ref = patch_longt5(make_model(case))
    model = patch_longt5(make_model(case), process_group=dist.group.WORLD, sync_bias_grads=case.sync_bias_grads)
    ids, mask = make_batch(case.length)
    tokens = BATCH * case.length

    def local(t):
        return shard(t, world_size, rank, dim=1)

    if case.model == "EncoderModel":
        want = ref(ids, attention_mask=mask).last_hidden_state
        got = model(local(ids), attention_mask=local(mask)).last_hidden_state
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
        (want * g).sum().backward()
        (got * local(g)).sum().backward()
        errors = {"encoder": excess(got, local(want), tokens)}
    else:
        dec_ids, _ = make_batch(16)
        # right padding only: under a process group a decoder query with no visible key (left padding) gets zeros,
        # not transformers' mean of the values (patch_t5's documented difference)
        dec_mask = torch.ones(BATCH, 16, dtype=torch.long)
        dec_mask[1, 11:] = 0
        labels = torch.randint(2, VOCAB, (BATCH, 16), generator=torch.Generator().manual_seed(3))

        want = seq2seq_step(ref, ids, mask, dec_ids, dec_mask, labels)
        got = seq2seq_step(model, *(local(t) for t in (ids, mask, dec_ids, dec_mask, labels)))
        errors = {"encoder": excess(got.encoder_last_hidden_state, local(want.encoder_last_hidden_state), tokens),
                  "logits": excess(got.logits, local(want.logits), tokens)}
    def whole(name, grad):  # the tables' come back summed over the group (sync_bias_grads); the others: sum here
        if case.sync_bias_grads and "relative_attention_bias" in name:
            return grad
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad

    errors.update(grad_errors(model, ref, tokens, whole))
    return {"errors": errors}


def run_refusal(name: str, rank: int, world_size: int) -> str | None:
    """Make the refused call; ``"TypeName: message"`` of what it raised, or None."""
    from relbias.integrations.longt5 import patch_longt5

    case = CASES[1]
    try:
        if name == "zigzag_layout":
            patch_longt5(make_model(case), process_group=dist.group.WORLD, layout="zigzag")
            return None
        model = patch_longt5(make_model(case), process_group=dist.group.WORLD)
        ids, mask = make_batch(12 * world_size)
        with torch.no_grad():
            if name == "shard_cuts_a_block":
                model.get_encoder()(input_ids=ids[:, :4], attention_mask=mask[:, :4])
            elif name == "generate":
                model.generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=2)
        if name == "dropout_in_training":
            model = patch_longt5(make_model(case, dropout_rate=0.1), process_group=dist.group.WORLD).train()
            model.get_encoder()(input_ids=ids[:, :12], attention_mask=mask[:, :12])
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks type and message
        return f"{type(exc).__name__}: {exc}"
    return None
