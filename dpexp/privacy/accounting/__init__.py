"""Privacy accounting for DP-SGD with Poisson subsampling at rate q, noise multiplier sigma and T steps.

One module per accountant, each with ``epsilon(compositions, q, delta)`` (``compositions``: ``(sigma, steps)``
pairs, so that a noise schedule whose sigma changes from step to step is accounted exactly, Monir et al.
2024, section 3.1.1) and ``KIND`` (an upper bound on the true epsilon, or an approximation), behind the
registry :data:`ACCOUNTANTS`; Li et al. (2022, appendix B) report all three for the same run:

- ``"rdp"`` (:mod:`.rdp`): Rényi DP, converted to (epsilon, delta); a strict upper bound.
- ``"prv"`` (:mod:`.prv`): numerical composition of privacy loss random variables; its upper bound.
- ``"gdp"`` (:mod:`.gdp`): the GDP central limit theorem, an approximation that can *underestimate*
  epsilon. It is reported, but :func:`get_noise_multiplier` calibrates with it only on request
  (``allow_approximation=True``): on the digits default (q = 128/1437, T = 225, delta = 1/(2N)) the sigma it
  solves for epsilon = 3, 1.65, spends 3.57 under RDP and 3.16 under the PRV upper bound.

Adding an accountant is one module with ``epsilon`` and ``KIND`` and one line in :data:`ACCOUNTANTS`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from types import ModuleType

from dpexp.privacy.accounting import gdp, prv, rdp

ACCOUNTANTS: dict[str, ModuleType] = {"rdp": rdp, "prv": prv, "gdp": gdp}
UPPER_BOUND = "upper_bound"
# What each accountant's epsilon is: an upper bound on the true epsilon, or the GDP CLT approximation.
EPSILON_KINDS = {name: module.KIND for name, module in ACCOUNTANTS.items()}
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
    return get_schedule_epsilon([noise_multiplier], sample_rate, delta, accountant, repeat=steps)


def get_schedule_epsilon(
    noise_multipliers: Sequence[float],
    sample_rate: float,
    delta: float,
    accountant: str = "rdp",
    repeat: int = 1,
) -> float:
    """Epsilon of one Poisson-subsampled Gaussian step (rate q) at every sigma of ``noise_multipliers`` (a
    noise schedule, one sigma per step, each taken ``repeat`` times), at delta: the steps compose whatever
    their order, so equal sigmas are accounted together. ``math.inf`` if any sigma is 0."""
    _check_accountant(accountant)
    _check_run(sample_rate, max(len(noise_multipliers), 1) * repeat)
    _check_delta(delta)
    if not len(noise_multipliers):
        return 0.0
    if not all(sigma >= 0 for sigma in noise_multipliers):
        raise ValueError(f"every noise_multiplier must be >= 0, got {min(noise_multipliers)}.")
    if min(noise_multipliers) == 0:
        return math.inf
    counts = Counter(float(sigma) for sigma in noise_multipliers)
    compositions = [(sigma, count * repeat) for sigma, count in sorted(counts.items())]
    return ACCOUNTANTS[accountant].epsilon(compositions, sample_rate, delta)


def steps_within_budget(
    noise_multipliers: Sequence[float],
    sample_rate: float,
    delta: float,
    target_epsilon: float,
    accountant: str = "rdp",
) -> int:
    """The largest t such that the first t steps of the schedule spend at most ``target_epsilon``: where a run
    stops when its budget is spent (budget-based stopping, Monir et al. 2024, section 6, Table 8). Epsilon
    grows with t, so t is found by bisection (O(log T) accountant calls)."""
    lo, hi = 0, len(noise_multipliers)  # epsilon(lo steps) <= target; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if get_schedule_epsilon(noise_multipliers[:mid], sample_rate, delta, accountant) <= target_epsilon:
            lo = mid
        else:
            hi = mid - 1
    return lo


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 1e-3,
    *,
    allow_approximation: bool = False,
    shape: Sequence[float] | None = None,
) -> float:
    """sigma with (1 - tolerance) target_epsilon <= get_epsilon(sigma, ...) <= target_epsilon.

    With a noise schedule's ``shape`` (``steps`` positive factors, :mod:`dpexp.privacy.noise_schedule`), the
    scale s such that the schedule ``s * shape`` spends the budget the same way (its first sigma when the
    shape starts at 1).

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
    if shape is None:
        shape = [1.0]
    elif len(shape) != steps or not all(0 < f < math.inf for f in shape):
        raise ValueError(f"a noise schedule's shape needs {steps} positive finite factors, got {len(shape)}.")
    return _solve_noise_multiplier(
        target_epsilon, target_delta, sample_rate, steps, accountant, tolerance, list(shape)
    )


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
    shape: list[float],
) -> float:
    """The search of :func:`get_noise_multiplier` on validated arguments, for any accountant; ``shape`` is
    the schedule's (one factor: constant sigma for all ``steps``)."""
    repeat = steps // len(shape)

    def excess(scale: float) -> float:  # relative excess over the budget, decreasing in the scale
        sigmas = [scale * f for f in shape]
        spent = get_schedule_epsilon(sigmas, sample_rate, target_delta, accountant, repeat)
        return spent / target_epsilon - 1

    if accountant == "prv":  # start near the solution, step gently: prv_accountant fails at too small sigma
        lo, hi = sorted(  # the GDP solution is only a starting point here: PRV decides
            _solve_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, other, tolerance, shape)
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
    return false_position(excess, lo, f_lo, hi, f_hi, tolerance)


def false_position(
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
