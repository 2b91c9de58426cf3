"""dpexp's own privacy engine behind the backend interface."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dpexp.backends.base import TrainingBackend, check_per_example_loss
from dpexp.privacy import PrivacyEngine
from dpexp.privacy.aggregation import StepAggregation
from dpexp.privacy.grouping import group_label
from dpexp.privacy.individual import IndividualPrivacy


class EngineBackend(TrainingBackend):
    """dpexp's own :class:`dpexp.privacy.PrivacyEngine` (BK, ghost, per-layer, group-wise, adaptive)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        batch_size: int,
        sample_size: int,
        max_grad_norm: float,
        noise_multiplier: float,
        engine_kwargs: Mapping[str, Any],
        individual: IndividualPrivacy | None = None,
        aggregation: StepAggregation | None = None,
    ) -> None:
        self.engine = PrivacyEngine(
            model,
            batch_size=batch_size,
            sample_size=sample_size,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            individual=individual,
            aggregation=aggregation,
            **engine_kwargs,
        )
        self.model = model
        self.optimizer = self.engine.attach(optimizer)

    def backward(self, per_example_loss: torch.Tensor, privacy_groups: torch.Tensor | None = None) -> None:
        check_per_example_loss(per_example_loss)
        self.engine.backward(per_example_loss, privacy_groups=privacy_groups)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        self.engine.detach()

    def released(self) -> dict[str, Any]:
        """Adaptive thresholds C_k (He et al. 2023, Algorithm 1; or norm-based), each moved only by noised
        counts or norms, so recording them is free, as ``{"thresholds": {label: C_k}}`` with one label per
        clipping group, ``"k module.path"`` (the module path its parameters share); fixed thresholds are the
        configuration's and not recorded."""
        if self.engine.adaptive is None:
            return {}
        values = self.engine.thresholds.tolist()
        return {
            "thresholds": {group_label(k, names): values[k] for k, names in enumerate(self.engine.groups)}
        }

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.engine.load_state_dict(state)


def build(
    clip_cfg: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    sample_size: int,
    noise_multiplier: float,
    individual: IndividualPrivacy | None = None,
    aggregation: StepAggregation | None = None,
) -> EngineBackend:
    return EngineBackend(
        model,
        optimizer,
        batch_size=batch_size,
        sample_size=sample_size,
        max_grad_norm=float(clip_cfg["max_grad_norm"]),
        noise_multiplier=noise_multiplier,
        engine_kwargs=clip_cfg["engine"],
        individual=individual,
        aggregation=aggregation,
    )
