"""The interface every training backend offers the trainer and the benchmark.

A logical step of DP-SGD (Abadi et al. 2016) with micro-batch accumulation is::

    for micro_batch in logical_batch:           # possibly none (empty Poisson batch)
        loss = backend.per_example_loss(task.per_example_loss, micro_batch)   # shape (b,)
        backend.backward(loss)                  # accumulate sum_i clip(g_i)
                                                # (privacy_groups=: each example's privacy group, IDP-SGD)
    backend.step()                              # once: + N(0, sigma^2 C^2 I), / B, optimizer step, zero grad

so noise is added exactly once per logical step and the sum is divided by the expected batch size B, never by
the realised Poisson batch size.

Data parallel (``distributed=ddp``, :mod:`dpexp.training.distributed`): every process runs the protocol above
on its own share of the same logical batch (possibly none), and every process calls ``backend.step()`` once
per logical step. The backend, built with an ``aggregation`` (:mod:`dpexp.privacy.aggregation`), lets only
one process draw the noise and sums the noised clipped sums over the processes inside ``step()``, before the
division by B: the same release as one process clipping the whole batch. ``step()`` is therefore a collective
call; a process that skips it stalls the others until the job's timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

# a task's per-example loss: (model, micro-batch) -> losses of shape (b,)
LossFunction = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


class TrainingBackend(ABC):
    """A model and optimizer wrapped for (private) training with micro-batch accumulation."""

    model: nn.Module  # the module to run forward passes on (possibly a wrapper of the original model)
    optimizer: torch.optim.Optimizer  # the (possibly wrapping) optimizer; its param_groups are the inner ones

    def per_example_loss(self, loss_fn: LossFunction, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's per-example losses, shape (b,): ``loss_fn(self.model, batch)`` (a pipeline
        stage runs its part of the model and gets the last stage's losses)."""
        return loss_fn(self.model, batch)

    @abstractmethod
    def backward(self, per_example_loss: torch.Tensor, privacy_groups: torch.Tensor | None = None) -> None:
        """Accumulate the (clipped) gradients of one micro-batch; ``per_example_loss`` has shape (b,);
        ``privacy_groups`` (b,): every example's privacy group under individualized privacy (backends
        without it refuse them: :func:`refuse_privacy_groups`)."""

    @abstractmethod
    def step(self) -> None:
        """End the logical step: add noise once, divide by the expected batch size, step, zero gradients."""

    @abstractmethod
    def close(self) -> None:
        """Remove hooks and restore the model."""

    def released(self) -> dict[str, Any]:
        """Values the backend has released under its accounted privacy (so a run record may keep them at no
        further cost), as JSON-ready values: e.g. the adaptive thresholds. Nothing by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the backend itself changes as it trains, beyond the model and the optimizer (for a
        checkpoint between steps); nothing by default."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, the checkpoint gives {sorted(state)}")


def refuse_privacy_groups(backend: str, privacy_groups: torch.Tensor | None) -> None:
    """Raise if a backend without individualized privacy is given privacy groups."""
    if privacy_groups is not None:
        raise ValueError(
            f"the {backend} backend has no individualized privacy: privacy.individual needs a dpexp clip "
            "(e.g. clip=bk)"
        )


def check_per_example_loss(loss: torch.Tensor) -> None:
    """Raise unless ``loss`` is one loss per example (shape (b,))."""
    if loss.dim() != 1:
        raise ValueError(
            f"Expected a per-example loss of shape (batch,), got shape {tuple(loss.shape)}; "
            "return reduction='none' losses (sequence tasks: sum the token losses per example)."
        )
