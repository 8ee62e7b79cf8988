"""Fine-tuning a patched T5 with dropout (issue 15, item 1): training mode with dropout_rate 0.1 and gradient
checkpointing runs, its loss and gradients are finite and equal between the reference and blockwise backends
under the same seed (the counter-based mask is the same), and a few optimizer steps lower the loss."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from relbias.integrations.transformers import patch_t5  # noqa: E402


def _train_steps(model, input_ids, attention_mask, labels, steps, seed):
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        if grads is None:
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("checkpointing", [False, True])
def test_patched_fine_tuning_with_dropout(hf, checkpointing):
    base = hf.tiny_model("t5", dropout_rate=0.1)
    input_ids, attention_mask = hf.batch(length=24, pad_last=5)
    labels, _ = hf.batch(length=12, seed=4)
    runs = {}
    for backend in ("reference", "blockwise"):
        model = patch_t5(copy.deepcopy(base), backend=backend).train()
        if checkpointing:
            hf.enable_checkpointing(model)
        runs[backend] = _train_steps(model, input_ids, attention_mask, labels, steps=4, seed=11)
    (losses, grads), (other_losses, other_grads) = runs["reference"], runs["blockwise"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(other_losses), rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(other_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    # the attention dropout is really applied: without it (eval-time dropout 0) the first loss differs
    model = patch_t5(copy.deepcopy(base), backend="reference").train()
    for module in model.modules():
        if hasattr(module, "dropout") and isinstance(module.dropout, float):
            module.dropout = 0.0
    undropped, _ = _train_steps(model, input_ids, attention_mask, labels, steps=1, seed=11)
    assert abs(undropped[0] - losses[0]) > 1e-6
