"""Rényi DP of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar & Zhang 2019, section 3.3),
composed over T steps (each with its own sigma under a noise schedule) and converted to (epsilon, delta)-DP
with Balle et al. (2020, Theorem 21), as Opacus does. A strict upper bound."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special

KIND = "upper_bound"

# Opacus' default orders (also those of Li et al.'s released code) plus large orders as in TF Privacy, so
# that small-epsilon / large-sigma runs do not sit at the grid's edge. More orders only tighten the bound.
RDP_ORDERS: tuple[float, ...] = (
    tuple(1 + x / 10 for x in range(1, 100))
    + tuple(float(a) for a in range(12, 64))
    + (80.0, 96.0, 128.0, 256.0)
)


def epsilon(compositions: Sequence[tuple[float, int]], sample_rate: float, delta: float) -> float:
    """Epsilon at ``delta`` of ``steps`` Poisson-subsampled Gaussian steps at noise multiplier sigma for every
    ``(sigma, steps)`` of ``compositions`` (validated, every sigma > 0): RDP adds up over steps, whatever each
    step's sigma (Mironov 2017, Proposition 1)."""
    orders = np.asarray(RDP_ORDERS)
    total = sum(steps * rdp_subsampled_gaussian(sigma, sample_rate, orders) for sigma, steps in compositions)
    return rdp_to_epsilon(orders, total, delta)


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
