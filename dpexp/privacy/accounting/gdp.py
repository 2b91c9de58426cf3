"""The central limit theorem of Gaussian DP (Dong, Roth & Su 2019, Theorem 3.4 and section 5; Bu et al. 2020
for Poisson subsampling): the run is approximately mu-GDP with mu = q sqrt(sum_t (e^{1/sigma_t^2} - 1)). An
approximation that can *underestimate* epsilon (Li et al. 2022, appendix B: "only provides approximations to
the actual loss under a finite number of compositions"); reported beside the upper bounds, and calibrating
with it needs an explicit opt-in (:func:`dpexp.privacy.accounting.get_noise_multiplier`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize, special

KIND = "clt_approximation"


def epsilon(compositions: Sequence[tuple[float, int]], sample_rate: float, delta: float) -> float:
    """The approximate epsilon at ``delta`` of ``steps`` steps at sigma for every ``(sigma, steps)`` of
    ``compositions`` (validated arguments, every sigma > 0)."""
    return gdp_epsilon(gdp_mu(compositions, sample_rate), delta)


def gdp_mu(compositions: Sequence[tuple[float, int]], sample_rate: float) -> float:
    """mu of the GDP central limit theorem for Poisson subsampling: q sqrt(sum_t (e^{1/sigma_t^2} - 1)), the
    sum over every step t (``steps`` of them at each ``(sigma, steps)``).

    Dong, Roth & Su (2019), section 5 and Theorem 5.2 (the CLT for a sequence of mechanisms), in the Poisson
    form of Bu et al. (2020); inf when e^{1/sigma^2} overflows. A constant sigma gives q sqrt(T (e^{1/sigma^2}
    - 1)).
    """
    total = 0.0
    for sigma, steps in compositions:
        with np.errstate(over="ignore"):
            growth = np.expm1(np.float64(sigma) ** -2.0)
        if not np.isfinite(growth):
            return math.inf
        total += steps * float(growth)
    return float(sample_rate * math.sqrt(total))


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
