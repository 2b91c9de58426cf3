"""Coordinate-wise adaptive clipping, AdaCliP (Pichapati et al. 2019; Monir et al. 2024, sec. 3.2.3).

Each example's gradient is centred and standardised coordinate by coordinate before it is clipped,

    w_i = (g_i - a) / b,   w_hat_i = w_i min(1, C / ||w_i||),   w_tilde = (sum_i w_hat_i + z) / B,
    z ~ N(0, sigma^2 C^2 I),   g_hat = b * w_tilde + a,

so the released sum ``sum_i w_hat_i`` has sensitivity C exactly as in DP-SGD (the survey writes C = 1) and
the privacy cost is DP-SGD's at the same sigma. ``a`` and ``b`` are functions of earlier *released*
gradients only (post-processing, no privacy cost): with ``m`` and ``v`` running estimates of each
coordinate's mean and variance,

    m_{t+1} = beta1 m_t + (1 - beta1) g_hat_t,
    v_{t+1} = beta2 v_t + (1 - beta2) ((g_hat_t - m_t)^2 - (b_t sigma C / B)^2)   (the noise variance removed)
    s_t = sqrt(clamp(v_t, h1, h2)),   a_t = m_t,   b_t = sqrt(s_t) sqrt(sum_j s_{t,j})   (j: the group's)

``b``'s form minimises the noise added to ``g_hat`` for standardised gradients (AdaCliP, sec. 4); the survey
gives the transform only, the moment updates are our reading of AdaCliP's Algorithm 1 (the clamp
``[h1, h2]`` keeps ``b`` away from 0 and infinity). With a group per layer (per-layer clipping), ``b`` is
normalised within each group, whose threshold is C_k.

Pure functions on tensors; :class:`dpexp.privacy.PrivacyEngine` holds the state (``coordinate=``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CoordinateConfig:
    """AdaCliP's hyperparameters (``clip.engine.coordinate``)."""

    beta1: float = 0.99  # mean estimate's decay
    beta2: float = 0.9  # variance estimate's decay
    variance_floor: float = 1e-12  # h1: smallest variance estimate (b stays positive)
    variance_ceiling: float = 1.0  # h2: largest variance estimate
    initial_variance: float = 1e-6  # v_0 of every coordinate (m_0 = 0)

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"coordinate.{name} must be in [0, 1), got {value}")
        if not 0.0 < self.variance_floor < self.variance_ceiling:
            raise ValueError(
                "coordinate.variance_floor and variance_ceiling must satisfy 0 < floor < ceiling, got "
                f"{self.variance_floor} and {self.variance_ceiling}"
            )
        if not self.variance_floor <= self.initial_variance <= self.variance_ceiling:
            raise ValueError(
                f"coordinate.initial_variance ({self.initial_variance}) must lie in [variance_floor, "
                f"variance_ceiling] = [{self.variance_floor}, {self.variance_ceiling}]"
            )


def group_scales(variances: Sequence[torch.Tensor], config: CoordinateConfig) -> list[torch.Tensor]:
    """``b_j = sqrt(s_j) sqrt(sum_l s_l)`` with ``s = sqrt(clamp(v, h1, h2))``, the sum over every coordinate
    of one group's parameters (``variances`` in the group's order); each result has its parameter's shape."""
    stds = [v.clamp(config.variance_floor, config.variance_ceiling).sqrt() for v in variances]
    total = sum(float(s.sum()) for s in stds)
    return [s.sqrt() * total**0.5 for s in stds]


def standardise(grad: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w_i = (g_i - a) / b`` for per-example gradients ``grad`` (B, *shape); ``shift``, ``scale``: shape."""
    return (grad - shift.to(grad.dtype)) / scale.to(grad.dtype)


def unstandardise(noisy_mean: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``g_hat = b w_tilde + a``: the released gradient from the noisy mean ``w_tilde`` in the standardised
    coordinates."""
    return noisy_mean * scale.to(noisy_mean.dtype) + shift.to(noisy_mean.dtype)


def update_moments(
    mean: Mapping[str, torch.Tensor],
    variance: Mapping[str, torch.Tensor],
    released: Mapping[str, torch.Tensor],
    noise_std: Mapping[str, torch.Tensor],
    config: CoordinateConfig,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(m_{t+1}, v_{t+1})`` from the released gradients ``g_hat_t`` and the per-coordinate standard
    deviation ``b_t sigma C / B`` of their noise (only released values: post-processing)."""
    new_mean, new_variance = {}, {}
    for name, g in released.items():
        m, v = mean[name], variance[name]
        g = g.to(m.dtype)
        new_mean[name] = config.beta1 * m + (1.0 - config.beta1) * g
        centred = (g - m).square() - noise_std[name].to(m.dtype).square()
        new_variance[name] = config.beta2 * v + (1.0 - config.beta2) * centred
    return new_mean, new_variance
