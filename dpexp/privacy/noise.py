"""Noise allocation across clipping groups (He et al. 2023, section 3.3 and appendix E).

Group k's clipped sum is scaled by ``1/gamma_k`` before the Gaussian mechanism and rescaled after, so it
receives noise of standard deviation ``sigma * S * gamma_k`` with ``S = sqrt(sum_k C_k^2 / gamma_k^2)``,
the L2 sensitivity of the scaled vector (Algorithm 1, line 13).
"""

from __future__ import annotations

from typing import Literal

import torch

Allocation = Literal["global", "equal_budget", "weighted"]


def allocation_weights(thresholds: torch.Tensor, dims: torch.Tensor, allocation: Allocation) -> torch.Tensor:
    """``gamma_k``: 1 (global), ``C_k`` (equal budget) or ``C_k / sqrt(d_k)`` (weighted)."""
    if allocation == "global":
        return torch.ones_like(thresholds)
    if allocation == "equal_budget":
        return thresholds.clone()
    if allocation == "weighted":
        return thresholds / dims.to(thresholds.dtype).sqrt()
    raise ValueError(f"unknown noise allocation {allocation!r}; valid: 'global', 'equal_budget', 'weighted'")


def noise_stds(
    thresholds: torch.Tensor, dims: torch.Tensor, noise_multiplier: float, allocation: Allocation
) -> torch.Tensor:
    """Per-group noise standard deviations ``sigma * S * gamma_k``, shape (K,)."""
    gamma = allocation_weights(thresholds, dims, allocation)
    sensitivity = (thresholds.pow(2) / gamma.pow(2)).sum().sqrt()
    return noise_multiplier * sensitivity * gamma
