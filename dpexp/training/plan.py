"""What a run fixes before it trains: the data set size N, batch size B and rate q = B/N, the number of
steps T, delta, and the noise multiplier sigma solved for the target epsilon with the calibrating accountant
(an upper bound, rdp or prv, unless the GDP approximation is opted into: :func:`calibration_accountant`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from dpexp.backends import is_private
from dpexp.privacy import accounting


@dataclass(frozen=True)
class RunPlan:
    """The quantities fixed before training; all of them go to metrics.json."""

    sample_size: int  # N, size of the private training set
    batch_size: int  # B, expected logical batch size
    physical_batch_size: int
    sample_rate: float  # q = B / N
    steps: int  # T
    epochs: float  # T * q
    delta: float
    target_epsilon: float | None  # None for non-private runs
    noise_multiplier: float  # sigma (0 for non-private runs)


def resolve_delta(delta: float | None, rule: str, sample_size: int) -> float:
    """``delta`` if given, else the rule's function of N (``1/2n``: 1/(2N), ``1/n^1.1``: N^-1.1)."""
    if delta is None:
        return accounting.default_delta(sample_size, rule)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"privacy.delta must be in (0, 1), got {delta}.")
    return float(delta)


ACCOUNTANT_KEYS = ("name", "approximate_calibration")


def calibration_accountant(cfg: DictConfig) -> tuple[str, bool]:
    """(name, allow_approximation) of the accountant that calibrates sigma, from the ``accountant`` group.

    Only upper bounds calibrate by default: a private run with ``accountant=gdp`` (the CLT approximation, see
    :mod:`dpexp.privacy.accounting`) is refused unless ``accountant.approximate_calibration=true``.
    """
    node = cfg.accountant
    unknown = sorted(set(node) - set(ACCOUNTANT_KEYS))
    if unknown:
        raise ValueError(f"Unknown accountant keys {unknown}; valid keys: {', '.join(ACCOUNTANT_KEYS)}.")
    approximate = node.get("approximate_calibration", False)
    if not isinstance(approximate, bool):
        raise ValueError(f"accountant.approximate_calibration must be true or false, got {approximate!r}.")
    kind = accounting.EPSILON_KINDS.get(node.name, accounting.UPPER_BOUND)
    if is_private(cfg.clip) and kind != accounting.UPPER_BOUND and not approximate:
        raise ValueError(
            f"accountant={node.name} calibrates sigma with the GDP central-limit approximation, which can "
            "underestimate epsilon: use accountant=rdp or accountant=prv (GDP is reported for every run "
            "anyway), or opt in with accountant.approximate_calibration=true."
        )
    return node.name, approximate


def check_run_keys(cfg: DictConfig) -> None:
    """Refuse sizes and intervals of the run that cannot work, whatever the data."""
    for key in ("batch_size", "physical_batch_size", "log_every", "eval_batch_size"):
        if cfg[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}.")
    if cfg.eval_every is not None and cfg.eval_every < 1:
        raise ValueError(
            f"eval_every must be a number of steps >= 1, or null to evaluate only at the end; "
            f"got {cfg.eval_every}."
        )


def target_epsilon(cfg: DictConfig) -> float | None:
    """``privacy.epsilon`` of a private run, refused unless a finite number > 0; None if not private."""
    if not is_private(cfg.clip):
        return None
    epsilon = cfg.privacy.epsilon
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(
            f"privacy.epsilon must be a finite number > 0, got {epsilon}; for a run without privacy use "
            "clip=nonprivate."
        )
    return float(epsilon)


def plan_run(
    cfg: DictConfig, sample_size: int, solve: Callable[..., float] = accounting.get_noise_multiplier
) -> RunPlan:
    """Steps, sampling rate, delta and the noise multiplier solved with :func:`calibration_accountant`
    (``solve`` has the signature of :func:`dpexp.privacy.accounting.get_noise_multiplier`)."""
    check_run_keys(cfg)
    if sample_size < 1:
        raise ValueError("The training set is empty: the task's training split has no examples.")
    batch_size = int(cfg.batch_size)
    if not 1 <= batch_size <= sample_size:
        raise ValueError(f"batch_size must be in [1, N={sample_size}], got {batch_size}.")
    sample_rate = batch_size / sample_size
    if cfg.steps is not None:
        steps = int(cfg.steps)
    elif cfg.epochs is not None:
        steps = round(cfg.epochs / sample_rate)
    else:
        raise ValueError("Set either epochs or steps.")
    if steps < 1:
        raise ValueError(
            f"The run must have at least one step, got {steps} (epochs={cfg.epochs}, steps={cfg.steps})."
        )
    delta = resolve_delta(cfg.privacy.delta, cfg.privacy.delta_rule, sample_size)
    epsilon = target_epsilon(cfg)
    sigma = 0.0
    if epsilon is not None:
        name, approximate = calibration_accountant(cfg)
        sigma = solve(epsilon, delta, sample_rate, steps, accountant=name, allow_approximation=approximate)
    return RunPlan(
        sample_size=sample_size,
        batch_size=batch_size,
        physical_batch_size=int(cfg.physical_batch_size),
        sample_rate=sample_rate,
        steps=steps,
        epochs=steps * sample_rate,
        delta=delta,
        target_epsilon=epsilon,
        noise_multiplier=sigma,
    )
