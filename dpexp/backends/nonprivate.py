"""Plain (non-private) training behind the backend interface: the baseline every ratio is measured against."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dpexp.backends.base import TrainingBackend, check_per_example_loss, refuse_privacy_groups


class NonPrivateBackend(TrainingBackend):
    """Plain training: gradient of sum_i loss_i / B (B the expected batch size), no clipping, no noise."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.batch_size = batch_size

    def backward(self, per_example_loss: torch.Tensor, privacy_groups: torch.Tensor | None = None) -> None:
        check_per_example_loss(per_example_loss)
        refuse_privacy_groups("nonprivate", privacy_groups)
        (per_example_loss.sum() / self.batch_size).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Nothing to undo: the model was not modified."""


def build(
    clip_cfg: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    sample_size: int,
    noise_multiplier: float,
) -> NonPrivateBackend:
    return NonPrivateBackend(model, optimizer, batch_size)
