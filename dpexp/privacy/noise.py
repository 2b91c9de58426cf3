"""Noise allocation across clipping groups (He et al. 2023, section 3.3 and appendix E).

Group k's clipped sum is scaled by ``1/gamma_k`` before the Gaussian mechanism and rescaled after, so it
receives noise of standard deviation ``sigma * S * gamma_k`` with ``S = sqrt(sum_k C_k^2 / gamma_k^2)``,
the L2 sensitivity of the scaled vector (Algorithm 1, line 13).
"""

from __future__ import annotations

from typing import Literal

import torch

Allocation = Literal["global", "equal_budget", "weighted"]

CPU_NOISE_CHUNK = 1 << 18  # values drawn at a time on CPU (1 MiB in float32: stays in cache)


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


def add_gaussian_noise_(
    tensor: torch.Tensor, std: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``tensor += z``, ``z ~ N(0, std^2 I)``, in place; returns ``tensor``.

    On CPU the noise is drawn chunk by chunk into one small buffer and added while it is still in cache: a
    tensor-sized temporary (64 MB for a 50k x 256 embedding) would be page-faulted in afresh at every step and
    read back from memory. Every element still gets its own independent draw.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        noise = torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=tensor.dtype)
        return tensor.add_(noise, alpha=std)
    flat = tensor.view(-1)
    buffer = torch.empty(min(CPU_NOISE_CHUNK, flat.numel()), dtype=tensor.dtype)
    for piece in flat.split(CPU_NOISE_CHUNK):
        piece.add_(buffer[: piece.numel()].normal_(generator=generator), alpha=std)
    return tensor
