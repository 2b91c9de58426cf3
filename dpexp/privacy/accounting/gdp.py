"""The central limit theorem of Gaussian DP (Dong, Roth & Su 2019, Theorem 3.4 and section 5; Bu et al. 2020
for Poisson subsampling): the run is approximately mu-GDP with mu = q sqrt(T (e^{1/sigma^2} - 1)). An
approximation that can *underestimate* epsilon (Li et al. 2022, appendix B: "only provides approximations to
the actual loss under a finite number of compositions"); reported beside the upper bounds, and calibrating
with it needs an explicit opt-in (:func:`dpexp.privacy.accounting.get_noise_multiplier`)."""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

KIND = "clt_approximation"


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """The approximate epsilon at ``delta`` of T = ``steps`` steps (validated arguments, sigma > 0)."""
    return gdp_epsilon(gdp_mu(noise_multiplier, sample_rate, steps), delta)


def gdp_mu(noise_multiplier: float, sample_rate: float, steps: int) -> float:
    """mu of the GDP central limit theorem for Poisson subsampling: q sqrt(T (e^{1/sigma^2} - 1)).

    Dong, Roth & Su (2019), section 5, in the Poisson form of Bu et al. (2020); inf when e^{1/sigma^2}
    overflows.
    """
    with np.errstate(over="ignore"):
        growth = np.expm1(np.float64(noise_multiplier) ** -2.0)
    return float(sample_rate * math.sqrt(steps * growth)) if np.isfinite(growth) else math.inf


def gdp_epsilon(mu: float, delta: float) -> float:
    """epsilon with delta(epsilon) = delta for a mu-GDP mechanism (Dong, Roth & Su 2019, Corollary 2.13).

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) decreases in eps; the root lies in
    [0, mu^2/2 - mu Phi^{-1}(delta)], where the first term alone is already <= delta.
    """
    if math.isinf(mu):
        return math.inf

    def excess(eps: float) -> float:
        first = special.ndtr(-eps / mu + mu / 2)
        second = math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))
        return first - second - delta

    if excess(0.0) <= 0:
        return 0.0
    return float(optimize.brentq(excess, 0.0, mu**2 / 2 - mu * special.ndtri(delta), xtol=1e-12))
