"""Numerical composition of privacy loss random variables (Gopi, Lee & Wutschitz 2021) through the
``prv_accountant`` package; its *upper* bound is returned (true epsilon + at most ``PRV_EPS_ERROR``)."""

from __future__ import annotations

import warnings

import numpy as np

KIND = "upper_bound"
PRV_EPS_ERROR = 0.01  # width of prv_accountant's error bar on epsilon (Opacus' default)


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Upper bound of Gopi et al. (2021) from ``prv_accountant`` (eps_error ``PRV_EPS_ERROR``, delta_error
    delta/1000, as Opacus' PRVAccountant)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prv = PoissonSubsampledGaussianMechanism(
        sampling_probability=sample_rate, noise_multiplier=noise_multiplier
    )
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            accountant = PRVAccountant(
                prvs=[prv], eps_error=PRV_EPS_ERROR, delta_error=delta / 1000, max_self_compositions=[steps]
            )
            _, _, eps_upper = accountant.compute_epsilon(delta=delta, num_self_compositions=[steps])
    except (ValueError, RuntimeError, MemoryError) as err:
        raise ValueError(
            f"The PRV accountant failed for sigma={noise_multiplier}, q={sample_rate}, T={steps}, "
            f"delta={delta}: {err}. Use accountant='rdp' for this regime."
        ) from err
    return float(eps_upper)
