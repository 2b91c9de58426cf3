"""Private quantile estimation of clipping thresholds (Andrew et al. 2021; He et al. 2023, Algorithm 1).

Each group k counts the examples it did not clip, ``b_{i,k} = 1[||g_{i,k}|| <= C_k]``. What is released is
the *centred* count ``s_k = sum_i (b_{i,k} - 1/2)``, whose sensitivity under adding or removing one example
is 1/2 (He et al. 2023, appendix D: the proof of Proposition 3.1 assumes exactly this; Algorithm 1, line 16
as printed omits the centring, and the uncentred count has sensitivity 1, twice what the budget split pays
for). It is privatised with Gaussian noise of std ``sigma_b`` (:func:`release_centred_counts`); the
fraction of unclipped examples is then estimated as ``b~_k = (s_k + z_k) / B + 1/2`` with the expected
batch size B (public), and the threshold follows the geometric update ``C_k <- C_k * exp(-eta (b~_k - q))``
(lines 15-17), so that a fraction ``q`` of per-example group norms ends up below ``C_k``. The budget split
between gradients and counts is Proposition 3.1 (``dpexp.privacy.accounting.split_noise_multiplier``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpexp.privacy.noise import standard_normal


@dataclass
class AdaptiveConfig:
    """``target_quantile`` q, ``quantile_lr`` eta, ``budget_fraction`` r; ``rescale_to_global`` keeps
    ``sqrt(sum_k C_k^2)`` equal to the configured C (used in He et al.'s CIFAR-10 runs)."""

    target_quantile: float = 0.5
    quantile_lr: float = 0.3
    budget_fraction: float = 0.01
    rescale_to_global: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.target_quantile < 1.0:
            raise ValueError(f"adaptive.target_quantile must be in (0, 1), got {self.target_quantile}")
        if self.quantile_lr <= 0:
            raise ValueError(f"adaptive.quantile_lr must be positive, got {self.quantile_lr}")
        if not 0.0 < self.budget_fraction < 1.0:
            raise ValueError(f"adaptive.budget_fraction must be in (0, 1), got {self.budget_fraction}")


def centred_counts(norms: torch.Tensor, threshold: float) -> torch.Tensor:
    """``sum_i (1[||g_i|| <= C] - 1/2)`` over a (micro-)batch of per-example norms, shape (b,) -> (); each
    example moves it by exactly 1/2."""
    return (norms <= threshold).double().sum() - 0.5 * norms.shape[0]


def release_centred_counts(
    counts: torch.Tensor,
    count_noise_std: float,
    generator: torch.Generator | None = None,
    secure: bool = False,
) -> torch.Tensor:
    """The Gaussian mechanism on the K centred counts: ``s_k + z_k`` with ``z_k ~ N(0, sigma_b^2)``, z from
    ``generator`` or (``secure``) the secure sampler (:func:`dpexp.privacy.noise.standard_normal`)."""
    noise = standard_normal(counts.shape, generator, secure) * count_noise_std
    return counts.double().cpu() + noise


def update_thresholds(
    thresholds: torch.Tensor,
    released_counts: torch.Tensor,
    batch_size: int,
    config: AdaptiveConfig,
    global_norm: float,
) -> torch.Tensor:
    """One step of Algorithm 1, lines 15-17, for all K groups at once, from the released centred counts
    (:func:`release_centred_counts`) and the expected batch size B; shapes (K,)."""
    fraction = released_counts.double() / batch_size + 0.5
    updated = thresholds.double() * torch.exp(-config.quantile_lr * (fraction - config.target_quantile))
    if config.rescale_to_global:
        updated = updated * (global_norm / updated.pow(2).sum().sqrt())
    if not math.isfinite(float(updated.sum())):
        raise FloatingPointError("adaptive clipping thresholds became non-finite")
    return updated.to(thresholds.dtype)
