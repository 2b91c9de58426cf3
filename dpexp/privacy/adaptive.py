"""Adaptive clipping thresholds from privately released statistics of the per-example group norms.

``method="quantile"``: private quantile estimation (Andrew et al. 2021; He et al. 2023, Algorithm 1).

Each group k counts the examples it did not clip, ``b_{i,k} = 1[||g_{i,k}|| <= C_k]``. What is released is
the *centred* count ``s_k = sum_i (b_{i,k} - 1/2)``, whose sensitivity under adding or removing one example
is 1/2 (He et al. 2023, appendix D: the proof of Proposition 3.1 assumes exactly this; Algorithm 1, line 16
as printed omits the centring, and the uncentred count has sensitivity 1, twice what the budget split pays
for). It is privatised with Gaussian noise of std ``sigma_b`` (:func:`release_statistics`); the
fraction of unclipped examples is then estimated as ``b~_k = (s_k + z_k) / B + 1/2`` with the expected
batch size B (public), and the threshold follows the geometric update ``C_k <- C_k * exp(-eta (b~_k - q))``
(lines 15-17), so that a fraction ``q`` of per-example group norms ends up below ``C_k``. The budget split
between gradients and counts is Proposition 3.1 (:func:`split_noise_multiplier`).

``method="norm"``: norm-based adaptive clipping (van der Veen et al. 2018; Monir et al. 2024, section 3.2.1).
Each group releases the sum of its per-example norms clipped at ``L_k = beta C_k``,
``n_k = sum_i min(||g_{i,k}||, L_k)`` (sensitivity L_k), with noise of std ``sigma_b L_k``
(:func:`clipped_norm_sums`, :func:`release_statistics`); the next threshold is
``C_k <- alpha (n_k + z_k) / B`` with the expected batch size B (van der Veen et al. divide by the batch's
own size, which is private under Poisson sampling), floored at a tenth of the previous threshold when the
noise makes the sum small or negative (post-processing). The budget split is Proposition 3.1 with
sensitivity 1 in units of L_k.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from dpexp.privacy.noise import standard_normal

ADAPTIVE_METHODS = ("quantile", "norm")
SENSITIVITY = {"quantile": 0.5, "norm": 1.0}  # of one released statistic, in its units (count, L_k)


@dataclass
class AdaptiveConfig:
    """``method`` (quantile | norm); quantile: ``target_quantile`` q, ``quantile_lr`` eta; norm:
    ``norm_factor`` alpha and ``bound_factor`` beta; ``budget_fraction`` r; ``rescale_to_global`` keeps
    ``sqrt(sum_k C_k^2)`` equal to the configured C (used in He et al.'s CIFAR-10 runs)."""

    target_quantile: float = 0.5
    quantile_lr: float = 0.3
    budget_fraction: float = 0.01
    rescale_to_global: bool = False
    method: str = "quantile"
    norm_factor: float = 1.0
    bound_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.method not in ADAPTIVE_METHODS:
            raise ValueError(
                f"adaptive.method must be one of {', '.join(ADAPTIVE_METHODS)}, got {self.method!r}"
            )
        for key in ("norm_factor", "bound_factor"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"adaptive.{key} must be a finite number > 0, got {value}")
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


def clipped_norm_sums(norms: torch.Tensor, bound: float) -> torch.Tensor:
    """``sum_i min(||g_i||, L)`` over a (micro-)batch of per-example norms, shape (b,) -> (); each example
    moves it by at most L (a norm that is not finite counts as L)."""
    clipped = torch.where(torch.isfinite(norms), norms.clamp(max=bound), bound)
    return clipped.double().sum()


def update_thresholds_from_norms(
    thresholds: torch.Tensor,
    released_sums: torch.Tensor,
    batch_size: int,
    config: AdaptiveConfig,
    global_norm: float,
) -> torch.Tensor:
    """``C_k <- max(alpha (n_k + z_k) / B, C_k / 10)`` for all K groups (van der Veen et al. 2018), B the
    expected batch size; shapes (K,)."""
    mean = config.norm_factor * released_sums.double() / batch_size
    return _finish_update(torch.maximum(mean, thresholds.double() / 10), thresholds, config, global_norm)


def _finish_update(
    updated: torch.Tensor, thresholds: torch.Tensor, config: AdaptiveConfig, global_norm: float
) -> torch.Tensor:
    """Both updates end here: rescaled to ``sqrt(sum_k C_k^2) = C`` if configured, refused if not finite."""
    if config.rescale_to_global:
        updated = updated * (global_norm / updated.pow(2).sum().sqrt())
    if not math.isfinite(float(updated.sum())):
        raise FloatingPointError("adaptive clipping thresholds became non-finite")
    return updated.to(thresholds.dtype)


def release_statistics(
    statistics: torch.Tensor,
    noise_std: float | torch.Tensor,
    generator: torch.Generator | None = None,
    secure: bool = False,
) -> torch.Tensor:
    """The Gaussian mechanism on the K statistics: ``s_k + z_k`` with ``z_k ~ N(0, std_k^2)``: ``sigma_b``
    for centred counts, ``sigma_b L_k`` for norm sums; z from ``generator`` or (``secure``) the secure sampler
    (:func:`dpexp.privacy.noise.standard_normal`)."""
    std = noise_std.double().cpu() if torch.is_tensor(noise_std) else noise_std
    return statistics.double().cpu() + standard_normal(statistics.shape, generator, secure) * std


def update_thresholds(
    thresholds: torch.Tensor,
    released_counts: torch.Tensor,
    batch_size: int,
    config: AdaptiveConfig,
    global_norm: float,
) -> torch.Tensor:
    """One step of Algorithm 1, lines 15-17, for all K groups at once, from the released centred counts
    (:func:`release_statistics`) and the expected batch size B; shapes (K,)."""
    fraction = released_counts.double() / batch_size + 0.5
    updated = thresholds.double() * torch.exp(-config.quantile_lr * (fraction - config.target_quantile))
    return _finish_update(updated, thresholds, config, global_norm)


def split_noise_multiplier(
    noise_multiplier: float, num_groups: int, budget_fraction: float, sensitivity: float = 0.5
) -> tuple[float, float]:
    """(sigma_new, sigma_b) from sigma, K groups and budget fraction r (He et al. 2023, Prop. 3.1, Rem. 3.1).

    Each step releases the gradient sum with noise sigma_new (sensitivity 1 in units of C) and K clip counts
    sum_i (b_k^(i) - 1/2) with noise sigma_b (sensitivity 1/2). Rescaled to unit noise this is one Gaussian
    mechanism with 1/sigma^2 = 1/sigma_new^2 + K/(2 sigma_b)^2 (appendix D), so the accounting done for sigma
    (any accountant) still holds. The counts take r = K sigma^2 / (4 sigma_b^2) of it: sigma_b =
    sigma sqrt(K / (4 r)) and sigma_new = (sigma^-2 - K/(2 sigma_b)^2)^(-1/2) = sigma / sqrt(1 - r).
    ``budget_fraction`` r = 0 means no quantile estimation: returns (sigma, inf). For statistics of another
    ``sensitivity`` s (in the units their noise is measured in: 1 for norm sums in units of L_k), the counts'
    share is K s^2 sigma^2 / sigma_b^2 = r, so sigma_b = sigma s sqrt(K / r).
    """
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
    if not (isinstance(num_groups, numbers.Integral) and num_groups >= 1):
        raise ValueError(f"num_groups (K) must be a positive integer, got {num_groups!r}.")
    if not 0 <= budget_fraction < 1:
        raise ValueError(
            f"budget_fraction (r, the share of the budget spent on quantile estimation) must be in [0, 1), "
            f"got {budget_fraction}."
        )
    if budget_fraction == 0:
        return float(noise_multiplier), math.inf
    sigma_b = noise_multiplier * sensitivity * math.sqrt(num_groups / budget_fraction)
    return noise_multiplier / math.sqrt(1 - budget_fraction), sigma_b
