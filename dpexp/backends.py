"""The small interface every clipping backend offers the trainer and the benchmark.

A logical step of DP-SGD (Abadi et al. 2016) with micro-batch accumulation is::

    for micro_batch in logical_batch:           # possibly none (empty Poisson batch)
        backend.backward(per_example_loss)      # shape (b,): accumulate sum_i clip(g_i)
    backend.step()                              # once: + N(0, sigma^2 C^2 I), / B, optimizer step, zero grad

so noise is added exactly once per logical step and the sum is divided by the expected batch size B, never by
the realised Poisson batch size. The backend is chosen by ``clip_cfg.backend`` (a key of :data:`BACKENDS`);
adding a clipping variant of an existing backend is one YAML file in ``conf/clip``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn


class TrainingBackend(ABC):
    """A model and optimizer wrapped for (private) training with micro-batch accumulation."""

    model: nn.Module  # the module to run forward passes on (possibly a wrapper of the original model)
    optimizer: torch.optim.Optimizer  # the (possibly wrapping) optimizer; its param_groups are the inner ones

    @abstractmethod
    def backward(self, per_example_loss: torch.Tensor) -> None:
        """Accumulate the (clipped) gradients of one micro-batch; ``per_example_loss`` has shape (b,)."""

    @abstractmethod
    def step(self) -> None:
        """End the logical step: add noise once, divide by the expected batch size, step, zero gradients."""

    @abstractmethod
    def close(self) -> None:
        """Remove hooks and restore the model."""


def check_per_example_loss(loss: torch.Tensor) -> None:
    """Raise unless ``loss`` is one loss per example (shape (b,))."""
    if loss.dim() != 1:
        raise ValueError(
            f"Expected a per-example loss of shape (batch,), got shape {tuple(loss.shape)}; "
            "return reduction='none' losses (sequence tasks: sum the token losses per example)."
        )


class NonPrivateBackend(TrainingBackend):
    """Plain training: gradient of sum_i loss_i / B (B the expected batch size), no clipping, no noise."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.batch_size = batch_size

    def backward(self, per_example_loss: torch.Tensor) -> None:
        check_per_example_loss(per_example_loss)
        (per_example_loss.sum() / self.batch_size).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Nothing to undo: the model was not modified."""


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
    ) -> None:
        from dpexp.privacy import PrivacyEngine

        self.engine = PrivacyEngine(
            model,
            batch_size=batch_size,
            sample_size=sample_size,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            **engine_kwargs,
        )
        self.model = model
        self.optimizer = self.engine.attach(optimizer)

    def backward(self, per_example_loss: torch.Tensor) -> None:
        check_per_example_loss(per_example_loss)
        self.engine.backward(per_example_loss)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        self.engine.detach()


def _build_nonprivate(clip_cfg, *, model, optimizer, batch_size, sample_size, noise_multiplier):
    return NonPrivateBackend(model, optimizer, batch_size)


def _build_opacus(clip_cfg, *, model, optimizer, batch_size, sample_size, noise_multiplier):
    opacus_backend = importlib.import_module("dpexp.privacy.opacus_backend")
    return opacus_backend.OpacusBackend(
        model,
        optimizer,
        batch_size=batch_size,
        max_grad_norm=float(clip_cfg["max_grad_norm"]),
        noise_multiplier=noise_multiplier,
        grad_sample_mode=clip_cfg["opacus"]["grad_sample_mode"],
        clipping=clip_cfg["opacus"]["clipping"],
    )


def _build_engine(clip_cfg, *, model, optimizer, batch_size, sample_size, noise_multiplier):
    return EngineBackend(
        model,
        optimizer,
        batch_size=batch_size,
        sample_size=sample_size,
        max_grad_norm=float(clip_cfg["max_grad_norm"]),
        noise_multiplier=noise_multiplier,
        engine_kwargs=clip_cfg["engine"],
    )


BACKENDS = {"nonprivate": _build_nonprivate, "opacus": _build_opacus, "dpexp": _build_engine}


def build_backend(
    clip_cfg: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    sample_size: int,
    noise_multiplier: float,
) -> TrainingBackend:
    """Wrap ``model`` and ``optimizer`` with the backend named by ``clip_cfg["backend"]``.

    ``batch_size`` is the expected logical batch size B (the divisor), ``sample_size`` the data set size N,
    ``noise_multiplier`` sigma (noise std sigma * C on the summed clipped gradient; ignored by nonprivate).
    Build ``optimizer`` over the model's trainable parameters before calling this.
    """
    if isinstance(clip_cfg, DictConfig):  # the engine and Opacus expect plain dicts and lists
        clip_cfg = OmegaConf.to_container(clip_cfg, resolve=True)
    name = clip_cfg["backend"]
    if name not in BACKENDS:
        raise ValueError(f"Unknown clip backend {name!r}; valid choices: {', '.join(BACKENDS)}.")
    return BACKENDS[name](
        clip_cfg,
        model=model,
        optimizer=optimizer,
        batch_size=batch_size,
        sample_size=sample_size,
        noise_multiplier=noise_multiplier,
    )


def is_private(clip_cfg: Mapping[str, Any]) -> bool:
    """Whether the clip config adds noise (every backend except ``nonprivate``)."""
    return clip_cfg["backend"] != "nonprivate"
