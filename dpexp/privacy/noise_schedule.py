"""Noise decay: the noise multiplier sigma_t of every step from a schedule's shape (Monir et al. 2024, section
3.1.1, after Yu et al. 2019, "pre-defined schedules").

A schedule is ``sigma_t = s * f(e_t)`` with f(0) = 1, f non-increasing and positive, and e_t = floor(t q) the
number of epochs completed before step t (q = B/N; the survey's t counts epochs):

- ``constant``:    f(e) = 1 (DP-SGD);
- ``time``:        f(e) = 1 / (1 + k e)                      (k > 0; k < 1: "search-then-converge");
- ``exponential``: f(e) = exp(-k e)                          (k > 0);
- ``step``:        f(e) = k^floor(e / period)                (0 < k < 1, every ``period`` epochs);
- ``polynomial``:  f(e) = (1 - r) (1 - min(e, P) / P)^k + r  (k > 0, P = ``period`` epochs, r = sigma_end / s
  in (0, 1]; k = 1 is linear decay).

The survey writes the polynomial schedule with an absolute sigma_end; here it is the fraction r of the first
sigma, so that one scale s describes the whole schedule: the accountant solves s for a target epsilon
(:func:`dpexp.privacy.accounting.get_noise_multiplier` with ``shape``), or s is given and the run stops when
the budget is spent (:func:`dpexp.privacy.accounting.steps_within_budget`). Every sigma_t is accounted
exactly (RDP adds up per step; PRV composes the distinct sigmas numerically; GDP's CLT sums e^{1/sigma_t^2}
- 1). The schedule is fixed before training and depends on no data, so it costs no privacy itself.
"""

from __future__ import annotations

import math
from typing import Literal

ScheduleName = Literal["constant", "time", "exponential", "step", "polynomial"]
SCHEDULES: tuple[str, ...] = ("constant", "time", "exponential", "step", "polynomial")


def check_schedule(
    name: str, rate: float | None = None, period: float | None = None, end_fraction: float | None = None
) -> None:
    """Refuse a schedule whose parameters are missing or out of range (ValueError naming the key)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown noise schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}.")
    needs_rate = name in ("time", "exponential", "step", "polynomial")
    if needs_rate and not (rate is not None and 0 < rate < math.inf):
        raise ValueError(f"the {name} noise schedule needs a decay rate k > 0 (noise.rate), got {rate}.")
    if name == "step" and not rate < 1:
        raise ValueError(
            "the step noise schedule multiplies sigma by k each period: k (noise.rate) must be in (0, 1), "
            f"got {rate}."
        )
    if name in ("step", "polynomial") and not (period is not None and 0 < period < math.inf):
        raise ValueError(
            f"the {name} noise schedule needs a period in epochs > 0 (noise.period), got {period}."
        )
    if name == "polynomial" and not (end_fraction is not None and 0 < end_fraction <= 1):
        raise ValueError(
            "the polynomial noise schedule ends at sigma_end = noise.end_fraction x its first sigma: "
            f"noise.end_fraction must be in (0, 1], got {end_fraction}."
        )


def schedule_shape(
    name: str,
    steps: int,
    sample_rate: float,
    rate: float | None = None,
    period: float | None = None,
    end_fraction: float | None = None,
) -> list[float]:
    """The factors f(e_t) of steps t = 0..steps-1 (f(0) = 1), e_t = floor(t q) epochs completed."""
    check_schedule(name, rate, period, end_fraction)
    epochs = [math.floor(t * sample_rate + 1e-9) for t in range(steps)]  # + 1e-9: t q integral in exact math
    if name == "constant":
        return [1.0] * steps
    if name == "time":
        return [1.0 / (1.0 + rate * e) for e in epochs]
    if name == "exponential":
        return [math.exp(-rate * e) for e in epochs]
    if name == "step":
        return [rate ** math.floor(e / period) for e in epochs]
    return [(1 - end_fraction) * (1 - min(e, period) / period) ** rate + end_fraction for e in epochs]
