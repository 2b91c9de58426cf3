"""Privacy accounting for DP-SGD with Poisson subsampling at rate q, noise multiplier sigma and T steps.

Three accountants (Li et al. 2022, appendix B, report all three for the same run):

- ``"rdp"``: Rényi DP of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar & Zhang 2019,
  section 3.3), composed over T steps and converted to (epsilon, delta)-DP with Balle et al. (2020,
  Theorem 21), as Opacus does. A strict upper bound.
- ``"prv"``: numerical composition of privacy loss random variables (Gopi, Lee & Wutschitz 2021) through the
  ``prv_accountant`` package; we return its *upper* bound (true epsilon + at most ``PRV_EPS_ERROR``).
- ``"gdp"``: the central limit theorem of Gaussian DP (Dong, Roth & Su 2019, Theorem 3.4 and section 5;
  Bu et al. 2020 for Poisson subsampling): the run is
  approximately mu-GDP with mu = q sqrt(T (e^{1/sigma^2} - 1)). An approximation that can *underestimate*
  epsilon (Li et al. 2022, appendix B: "only provides approximations to the actual loss under a finite
  number of compositions"). It is reported, but :func:`get_noise_multiplier` calibrates with it only on
  request (``allow_approximation=True``): on the digits default (q = 128/1437, T = 225, delta = 1/(2N)) the
  sigma it solves for epsilon = 3, 1.65, spends 3.57 under RDP and 3.16 under the PRV upper bound.

Also the budget split of He et al. (2023, Proposition 3.1) for private quantile estimation.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable

import numpy as np
from scipy import optimize, special

ACCOUNTANTS = ("rdp", "prv", "gdp")
UPPER_BOUND = "upper_bound"
# What each accountant's epsilon is: an upper bound on the true epsilon, or the GDP CLT approximation.
EPSILON_KINDS = {"rdp": UPPER_BOUND, "prv": UPPER_BOUND, "gdp": "clt_approximation"}

# Opacus' default orders (also those of Li et al.'s released code) plus large orders as in TF Privacy, so
# that small-epsilon / large-sigma runs do not sit at the grid's edge. More orders only tighten the bound.
RDP_ORDERS: tuple[float, ...] = (
    tuple(1 + x / 10 for x in range(1, 100))
    + tuple(float(a) for a in range(12, 64))
    + (80.0, 96.0, 128.0, 256.0)
)
PRV_EPS_ERROR = 0.01  # width of prv_accountant's error bar on epsilon (Opacus' default)
MAX_NOISE_MULTIPLIER = 1e4  # get_noise_multiplier gives up above this sigma
DELTA_RULES = {
    "1/2n": lambda n: 1.0 / (2 * n),  # Li et al. 2022, section 3
    "1/n^1.1": lambda n: float(n) ** -1.1,  # He et al. 2023, section 5.2
}


def default_delta(n: int, rule: str = "1/2n") -> float:
    """delta as a function of the training set size n: ``"1/2n"`` (Li et al.) or ``"1/n^1.1"`` (He et al.)."""
    if rule not in DELTA_RULES:
        raise ValueError(f"Unknown delta rule {rule!r}; valid rules: {', '.join(DELTA_RULES)}.")
    if not (isinstance(n, numbers.Integral) and n >= 1):
        raise ValueError(f"The training set size n must be a positive integer, got {n!r}.")
    return DELTA_RULES[rule](n)


def get_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of T = ``steps`` Poisson-subsampled Gaussian steps (rate q, noise multiplier sigma), at delta.

    Returns ``math.inf`` for sigma = 0 (no noise, no privacy).
    """
    _check_accountant(accountant)
    _check_run(sample_rate, steps)
    _check_delta(delta)
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
    if noise_multiplier == 0:
        return math.inf
    if accountant == "rdp":
        orders = np.asarray(RDP_ORDERS)
        rdp = steps * rdp_subsampled_gaussian(noise_multiplier, sample_rate, orders)
        return rdp_to_epsilon(orders, rdp, delta)
    if accountant == "gdp":
        return gdp_epsilon(gdp_mu(noise_multiplier, sample_rate, steps), delta)
    return _prv_epsilon(noise_multiplier, sample_rate, steps, delta)


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 1e-3,
    *,
    allow_approximation: bool = False,
) -> float:
    """sigma with (1 - tolerance) target_epsilon <= get_epsilon(sigma, ...) <= target_epsilon.

    Li et al. (2022), appendix B: "numerically invert" the accountant. sigma is bracketed (steps of 1.5x from
    1, or for the costly PRV 1.1x from the GDP and RDP solutions, which usually under- and overestimate it),
    then the bracket shrinks by false position with the Illinois modification in log sigma, keeping
    epsilon(hi) <= target < epsilon(lo). The returned ``hi`` never exceeds the budget of that accountant.
    Only the upper bounds (rdp, prv) calibrate by default: ``accountant="gdp"`` raises ValueError unless
    ``allow_approximation=True``, and then warns (UserWarning) that epsilon may be underestimated.
    Raises ValueError when even sigma = ``MAX_NOISE_MULTIPLIER`` exceeds the budget.
    """
    _check_accountant(accountant)
    if EPSILON_KINDS[accountant] != UPPER_BOUND:
        _check_approximation_allowed(accountant, allow_approximation)
    _check_run(sample_rate, steps)
    _check_delta(target_delta)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(
            f"target_epsilon must be a finite number > 0, got {target_epsilon} "
            "(a non-private run needs no noise multiplier)."
        )
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance (relative, on epsilon) must be in (0, 1), got {tolerance}.")
    return _solve_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, accountant, tolerance)


def _check_approximation_allowed(accountant: str, allow_approximation: bool) -> None:
    """Refuse calibration with an approximate accountant unless allowed; warn when allowed."""
    if not allow_approximation:
        raise ValueError(
            f"accountant={accountant!r} is the GDP central-limit approximation (Dong, Roth & Su 2019), "
            "which can underestimate epsilon, so a sigma calibrated with it can exceed the budget: "
            "calibrate with 'rdp' or 'prv' (upper bounds), or opt in with allow_approximation=True."
        )
    warnings.warn(
        f"sigma is calibrated with the {accountant!r} central-limit approximation: the run's epsilon may be "
        "underestimated (check it under 'rdp' or 'prv').",
        UserWarning,
        stacklevel=3,
    )


def _solve_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    tolerance: float,
) -> float:
    """The search of :func:`get_noise_multiplier` on validated arguments, for any accountant."""

    def excess(sigma: float) -> float:  # relative excess over the budget, decreasing in sigma
        return get_epsilon(sigma, sample_rate, steps, target_delta, accountant) / target_epsilon - 1

    if accountant == "prv":  # start near the solution, step gently: prv_accountant fails at too small sigma
        lo, hi = sorted(  # the GDP solution is only a starting point here: PRV decides
            _solve_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, other, tolerance)
            for other in ("gdp", "rdp")
        )
        factor = 1.1
    else:
        lo, hi, factor = 2 / 3, 1.0, 1.5
    f_lo, f_hi = excess(lo), excess(hi)
    while f_hi > 0:
        lo, f_lo, hi = hi, f_hi, factor * hi
        if hi > MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"Cannot reach epsilon={target_epsilon} at delta={target_delta} with the {accountant!r} "
                f"accountant (q={sample_rate}, T={steps}) with any noise_multiplier <= "
                f"{MAX_NOISE_MULTIPLIER:g}: epsilon is still "
                f"{(excess(MAX_NOISE_MULTIPLIER) + 1) * target_epsilon:.4g} there. Increase epsilon or "
                "delta, or reduce the number of steps or the sampling rate."
            )
        f_hi = excess(hi)
    while f_lo <= 0:
        hi, f_hi, lo = lo, f_lo, lo / factor
        f_lo = excess(lo)
    return _illinois(excess, lo, f_lo, hi, f_hi, tolerance)


def _illinois(
    excess: Callable[[float], float], lo: float, f_lo: float, hi: float, f_hi: float, tolerance: float
) -> float:
    """Shrink the bracket excess(lo) > 0 >= excess(hi) until excess(hi) >= -tolerance; return hi.

    False position on x = log sigma; when the same end survives twice its weight is halved (Illinois), which
    keeps both ends moving. Stops after 100 evaluations or when the bracket is at floating-point resolution.
    """
    w_lo, w_hi, moved = f_lo, f_hi, ""
    for _ in range(100):
        if f_hi >= -tolerance or hi - lo <= 1e-12 * hi:
            break
        t = w_lo / (w_lo - w_hi) if math.isfinite(w_lo) else 0.5
        sigma = lo * (hi / lo) ** t
        f = excess(sigma)
        if f <= 0:
            hi, f_hi, w_hi = sigma, f, f
            w_lo = w_lo / 2 if moved == "hi" else w_lo
            moved = "hi"
        else:
            lo, f_lo, w_lo = sigma, f, f
            w_hi = w_hi / 2 if moved == "lo" else w_hi
            moved = "lo"
    return hi


def split_noise_multiplier(
    noise_multiplier: float, num_groups: int, budget_fraction: float
) -> tuple[float, float]:
    """(sigma_new, sigma_b) from sigma, K groups and budget fraction r (He et al. 2023, Prop. 3.1, Rem. 3.1).

    Each step releases the gradient sum with noise sigma_new (sensitivity 1 in units of C) and K clip counts
    sum_i (b_k^(i) - 1/2) with noise sigma_b (sensitivity 1/2). Rescaled to unit noise this is one Gaussian
    mechanism with 1/sigma^2 = 1/sigma_new^2 + K/(2 sigma_b)^2 (appendix D), so the accounting done for sigma
    (any accountant) still holds. The counts take r = K sigma^2 / (4 sigma_b^2) of it: sigma_b =
    sigma sqrt(K / (4 r)) and sigma_new = (sigma^-2 - K/(2 sigma_b)^2)^(-1/2) = sigma / sqrt(1 - r).
    ``budget_fraction`` r = 0 means no quantile estimation: returns (sigma, inf).
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
    sigma_b = noise_multiplier * math.sqrt(num_groups / (4 * budget_fraction))
    return noise_multiplier / math.sqrt(1 - budget_fraction), sigma_b


def rdp_subsampled_gaussian(noise_multiplier: float, sample_rate: float, orders: np.ndarray) -> np.ndarray:
    """RDP epsilon(alpha) of one Poisson-subsampled Gaussian step, shape ``orders.shape`` (orders > 1).

    Mironov, Talwar & Zhang (2019), section 3.3: epsilon(alpha) = log(A_alpha) / (alpha - 1), A_alpha =
    E_{z~mu_0} [((1 - q) + q mu_1(z)/mu_0(z))^alpha] with mu_0 = N(0, sigma^2), mu_1 = N(1, sigma^2);
    q = 1 is the plain Gaussian mechanism, alpha / (2 sigma^2).
    """
    orders = np.asarray(orders, dtype=float)
    if sample_rate == 1:
        return orders / (2 * noise_multiplier**2)
    flat = orders.ravel()
    integer = flat == np.round(flat)
    log_a = np.empty_like(flat)
    log_a[integer] = _log_a_int(sample_rate, noise_multiplier, flat[integer])
    log_a[~integer] = _log_a_frac(sample_rate, noise_multiplier, flat[~integer])
    return (log_a / (flat - 1)).reshape(orders.shape)


def rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta)-DP from RDP: Balle et al. (2020), Theorem 21 (also Canonne, Kamath & Steinke 2020).

    epsilon = min over alpha of rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1),
    floored at 0.
    """
    orders = np.asarray(orders, dtype=float)
    eps = np.asarray(rdp) + np.log1p(-1 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    return max(float(np.nanmin(eps)), 0.0)


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


def _prv_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
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


def _log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha for integer orders, shape (m,): binomial expansion
    log sum_{i<=alpha} C(alpha, i) q^i (1 - q)^(alpha - i) exp((i^2 - i) / (2 sigma^2))."""
    if alphas.size == 0:
        return alphas
    a = alphas[:, None]
    i = np.arange(alphas.max() + 1)[None, :]
    with np.errstate(invalid="ignore"):  # C(alpha, i) = 0 (log: -inf) for i > alpha
        log_terms = (
            _log_binom(a, i) + i * math.log(q) + (a - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
        )
    return special.logsumexp(log_terms, axis=1)


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha for fractional orders, shape (m,): the two series split at z0 = sigma^2 log(1/q - 1) + 1/2
    (Mironov et al. 2019, section 3.3), each order summed up to the first index where both of its terms drop
    below e^-30 (the rule of Opacus and TF Privacy). The terms decay only polynomially for orders near 1, so
    each order gets as many terms as it needs (the number grows 4x per round). C(alpha, i) changes sign for
    i > alpha + 1: positive and negative terms are summed separately in log space."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_a = np.empty_like(alphas)
    todo = np.arange(alphas.size)
    length = 64
    while todo.size:
        a = alphas[todo, None]
        i = np.arange(length)[None, :]
        j = a - i
        log_coef = _log_binom(a, i)
        log_s0 = (
            log_coef
            + i * math.log(q)
            + j * math.log1p(-q)
            + (i * i - i) / (2 * sigma**2)
            + special.log_ndtr((z0 - i) / sigma)
        )
        log_s1 = (
            log_coef
            + j * math.log(q)
            + i * math.log1p(-q)
            + (j * j - j) / (2 * sigma**2)
            + special.log_ndtr((j - z0) / sigma)
        )
        small = np.maximum(log_s0, log_s1) < -30
        done = small.any(axis=1)
        kept = np.tile(i <= small.argmax(axis=1)[:, None], 2)[done]
        log_terms = np.where(kept, np.concatenate([log_s0, log_s1], axis=1)[done], -np.inf)
        sign = np.tile(special.gammasgn(a - i + 1), 2)[done]
        with np.errstate(divide="ignore"):
            positive = special.logsumexp(np.where(sign > 0, log_terms, -np.inf), axis=1)
            negative = special.logsumexp(np.where(sign < 0, log_terms, -np.inf), axis=1)
        log_a[todo[done]] = positive + np.log1p(-np.exp(negative - positive))
        todo = todo[~done]
        length *= 4
    return log_a


def _log_binom(n: float, k: np.ndarray) -> np.ndarray:
    """log |C(n, k)| for real n >= 0 and integer k >= 0 (also k > n, where C(n, k) may be negative)."""
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"Unknown accountant {accountant!r}; valid accountants: {', '.join(ACCOUNTANTS)}.")


def _check_run(sample_rate: float, steps: int) -> None:
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate (q = B/N) must be in (0, 1], got {sample_rate}.")
    if not (isinstance(steps, numbers.Integral) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta} (the papers use 1/(2N) or N^-1.1).")
