"""Numerical composition of privacy loss random variables (Gopi, Lee & Wutschitz 2021) through the
``prv_accountant`` package; its *upper* bound is returned (true epsilon + at most ``PRV_EPS_ERROR``)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

KIND = "upper_bound"
PRV_EPS_ERROR = 0.01  # width of prv_accountant's error bar on epsilon (Opacus' default)


def epsilon(compositions: Sequence[tuple[float, int]], sample_rate: float, delta: float) -> float:
    """Upper bound of Gopi et al. (2021) from ``prv_accountant`` (eps_error ``PRV_EPS_ERROR``, delta_error
    delta/1000, as Opacus' PRVAccountant) for ``steps`` steps at sigma for every ``(sigma, steps)`` of
    ``compositions``: one privacy loss random variable per distinct sigma, composed numerically (their
    heterogeneous composition, section 5)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prvs = [
        PoissonSubsampledGaussianMechanism(sampling_probability=sample_rate, noise_multiplier=sigma)
        for sigma, _ in compositions
    ]
    counts = [int(steps) for _, steps in compositions]
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            accountant = PRVAccountant(
                prvs=prvs, eps_error=PRV_EPS_ERROR, delta_error=delta / 1000, max_self_compositions=counts
            )
            _, _, eps_upper = accountant.compute_epsilon(delta=delta, num_self_compositions=counts)
    except (ValueError, RuntimeError, MemoryError) as err:
        sigmas = sorted({sigma for sigma, _ in compositions})
        raise ValueError(
            f"The PRV accountant failed for sigma in [{sigmas[0]:.4g}, {sigmas[-1]:.4g}], q={sample_rate}, "
            f"T={sum(counts)}, delta={delta}: {err}. Use accountant='rdp' for this regime."
        ) from err
    return float(eps_upper)
