"""Training a :class:`relbias.experiments.ByteLM` on random windows of one fixed length."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from .model import ByteLM
from .data import sample_batch

__all__ = ["TrainConfig", "Progress", "train_model", "no_progress"]

#: ``progress(iterable, *, desc, total)`` -> iterable; ``tqdm.tqdm`` fits. The library itself never prints.
Progress = Callable[..., Iterable]


def no_progress(iterable: Iterable, **_: object) -> Iterable:
    """The default progress hook: the iterable unchanged."""
    return iterable


@dataclass(frozen=True)
class TrainConfig:
    """How to train.

    Attributes:
        steps: optimizer steps. Default 1200.
        batch_size: windows per step. Default 32.
        lr: peak learning rate of AdamW (Loshchilov & Hutter 2019). Default 3e-3.
        warmup: linear warm-up steps, then cosine decay to ``lr / 10``. Default 50.
        weight_decay: AdamW weight decay on matrices (not on biases, norms or position biases). Default 0.01.
        grad_clip: clip the global gradient norm to this. Default 1.0.
        seed: seeds the window sampler (run_extrapolation also seeds the initialisation with it). Default 0.

    Raises:
        ValueError: ``steps`` or ``batch_size`` < 1, ``warmup`` < 0, a learning rate or gradient clip that
            is not a positive finite number, a weight decay that is negative or not finite.
    """

    steps: int = 1200
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("steps", 1), ("batch_size", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        for name, positive in (("lr", True), ("grad_clip", True), ("weight_decay", False)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} finite number, got {value!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate at ``step`` (0-based): linear warm-up, then cosine from ``lr`` to ``lr / 10``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _param_groups(model: ByteLM, weight_decay: float) -> list[dict]:
    bias_params = {id(p) for b in model.position_biases for p in b.parameters()}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in bias_params]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or id(p) in bias_params]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_model(
    model: ByteLM, train_tokens: torch.Tensor, config: TrainConfig, *, progress: Progress = no_progress
) -> list[float]:
    """Train next-byte prediction on windows of ``model.config.max_len`` tokens.

    Each step draws ``batch_size`` random windows (:func:`~relbias.experiments.data.sample_batch`,
    seeded by ``config.seed``) and minimises the mean cross-entropy with AdamW.

    Args:
        model: the model; trained in place, left in eval mode.
        train_tokens: uint8 (N,) training bytes, N > ``max_len``.
        config: a :class:`TrainConfig`.
        progress: progress hook, e.g. ``tqdm.tqdm``; its bar's postfix shows the loss when it has
            ``set_postfix``.

    Returns:
        The training loss of every step, nats per byte.

    Raises:
        ValueError: fewer than ``max_len + 1`` training bytes; a non-finite loss (diverged training).
    """
    length = model.config.max_len
    if len(train_tokens) <= length:
        raise ValueError(
            f"the training split has {len(train_tokens)} bytes, not more than the training length {length}; "
            f"use a larger corpus or a shorter --train-len"
        )
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.99))
    model.train()
    losses: list[float] = []
    bar = progress(range(config.steps), desc="train", total=config.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        inputs, targets = sample_batch(train_tokens, length, config.batch_size, generator)
        logits = model(inputs)  # (B, L, 256)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if not torch.isfinite(loss):
            raise ValueError(f"training diverged at step {step}: loss {loss.item()}; try a smaller lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix") and step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return losses
