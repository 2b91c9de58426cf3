"""Classification accuracy: the fraction of examples whose highest logit is the true label."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Number of rows of ``logits`` (B, K) whose argmax equals ``labels`` (B,)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"Expected logits (B, K) and labels (B,), got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    return int((logits.argmax(dim=1) == labels).sum())


@torch.no_grad()
def accuracy(
    model: nn.Module,
    examples: Sequence[Any],
    collate: Callable[[list[Any]], Batch],
    logits_fn: Callable[[nn.Module, Batch], torch.Tensor],
    batch_size: int,
    label_key: str = "label",
) -> float:
    """Accuracy of ``model`` on ``examples``, batched by ``collate`` and scored by ``logits_fn`` (B, K).

    Runs in eval mode without gradients on the device of the model's parameters, and restores the model's
    previous train/eval mode afterwards.
    """
    if len(examples) == 0:
        raise ValueError("Cannot compute accuracy on an empty evaluation set.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(examples), batch_size):
            batch = collate([examples[i] for i in range(start, min(start + batch_size, len(examples)))])
            batch = {key: value.to(device) for key, value in batch.items()}
            correct += count_correct(logits_fn(model, batch), batch[label_key])
    finally:
        model.train(was_training)
    return correct / len(examples)
