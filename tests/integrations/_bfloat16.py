"""Checks shared by the bfloat16 model tests (not a test module): a patched bfloat16 model against transformers'
own bfloat16 model and the float32 one."""

import torch

EPS = torch.finfo(torch.bfloat16).eps


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64."""
    return (got.double() - want.double()).abs().max().item() / want.double().abs().max().item()


def assert_generate_and_training_step_as_transformers(full, plain, patched, ids, mask, labels, **generate):
    """Greedy tokens of the bfloat16 models ``plain`` (transformers) and ``patched`` agree wherever transformers'
    bfloat16 tokens are the float32 model's (``full``; elsewhere rounding flipped a near tie); one training step's
    loss within 4 eps and gradient norm within 5% of transformers' bfloat16 model's."""
    with torch.no_grad():
        settings = dict(attention_mask=mask, do_sample=False, **generate)
        reference = full.generate(ids, **settings)
        theirs, ours = plain.generate(ids, **settings), patched.generate(ids, **settings)
    agree = (theirs == reference).all(-1)
    assert torch.equal(ours[agree], theirs[agree])
    losses, norms = [], []
    for model in (plain, patched):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)))
        model.eval()
    assert abs(losses[0] - losses[1]) <= 4 * EPS * abs(losses[0]), losses
    assert abs(norms[0] - norms[1]).item() <= 0.05 * norms[0].item(), norms
    return agree
