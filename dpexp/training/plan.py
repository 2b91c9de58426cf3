"""What a run fixes before it trains: the data set size N, batch size B and rate q = B/N, the number of
steps T, delta, and the noise multiplier sigma solved for the target epsilon with the calibrating accountant
(an upper bound, rdp or prv, unless the GDP approximation is opted into: :func:`calibration_accountant`).

With a noise schedule (``noise`` group, :mod:`dpexp.privacy.noise_schedule`) sigma is the first step's and
every step has its own; with ``noise.initial`` given instead of solved, T is where the budget is spent.

With ``privacy.noise_multiplier`` sigma is set directly (the schedule's scale, no calibration, T as planned)
and the run only reports the epsilon it spends.

With individualized privacy (``privacy.individual``, :mod:`dpexp.privacy.individual`) sigma and every
group's sample rate q_g and clipping scale s_g are solved for the group budgets epsilon_g (the plan's
``individual``), and ``target_epsilon`` is the largest of them."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from dpexp.backends import is_private, method_of
from dpexp.privacy import accounting, individual
from dpexp.privacy.noise_schedule import check_schedule, schedule_shape
from dpexp.training.individual import variant_of


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
    target_epsilon: float | None  # None for non-private runs and for sigma set directly
    noise_multiplier: float  # sigma of the first step (0 for non-private runs)
    noise_schedule: str  # constant | time | exponential | step | polynomial
    noise_multipliers: list[float]  # sigma of every step (empty exactly for non-private runs)
    stopped_at_budget: bool  # T is where noise.initial's schedule spends the budget (budget-based stopping)
    # individualized privacy: variant, epsilons, group_sizes, sample_rates (q_g), scales (s_g) and
    # noise_multipliers (sigma / s_g, the first step's) of every group; None without it
    individual: dict | None = None


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


def check_noise(cfg: DictConfig) -> None:
    """Refuse a noise schedule that cannot work (``noise`` group), naming the key, before any data loads."""
    noise = cfg.noise
    try:
        check_schedule(noise.name, noise.rate, noise.period, noise.end_fraction)
    except ValueError as error:
        raise ValueError(f"{error} (conf/noise/{noise.name}.yaml documents the keys)") from None
    if noise.initial is not None and not (noise.initial > 0 and math.isfinite(noise.initial)):
        raise ValueError(
            f"noise.initial must be a finite sigma > 0, or null to solve it for privacy.epsilon; "
            f"got {noise.initial}."
        )
    if noise.initial is not None and not is_private(cfg.clip):
        raise ValueError("noise.initial sets the noise of a private run; clip=nonprivate adds none.")
    if noise.name != "constant" and method_of(cfg.clip) == "opacus":
        raise ValueError(
            f"noise={noise.name}: the Opacus baseline adds one sigma for the whole run; noise schedules need "
            "a dpexp clip (e.g. clip=bk), or noise=constant."
        )


def direct_noise_multiplier(cfg: DictConfig) -> float | None:
    """``privacy.noise_multiplier``: sigma set directly (the noise schedule's scale), skipping calibration;
    None when sigma is solved for ``privacy.epsilon``. Refused unless a finite number >= 0, on a non-private
    run, beside ``noise.initial`` (another fixed sigma) or individualized privacy (which solves its own);
    0 warns: no privacy at all."""
    sigma = cfg.privacy.get("noise_multiplier")
    if sigma is None:
        return None
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(
            f"privacy.noise_multiplier must be a finite sigma >= 0, or null to solve it for privacy.epsilon; "
            f"got {sigma}."
        )
    if not is_private(cfg.clip):
        raise ValueError("privacy.noise_multiplier sets a private run's noise; clip=nonprivate adds none.")
    if cfg.noise.initial is not None:
        raise ValueError(
            f"privacy.noise_multiplier={sigma} and noise.initial={cfg.noise.initial} both fix sigma: set one "
            "(noise.initial stops the run where privacy.epsilon is spent; privacy.noise_multiplier does not)."
        )
    if variant_of(cfg) is not None:
        raise ValueError(
            "privacy.noise_multiplier: individualized privacy (privacy.individual) solves sigma for the "
            "group budgets; set privacy.noise_multiplier=null."
        )
    if sigma == 0:
        warnings.warn(
            "privacy.noise_multiplier=0: no noise, no privacy (epsilon = inf); use only for testing.",
            stacklevel=1,
        )
    return float(sigma)


def target_epsilon(cfg: DictConfig) -> float | None:
    """``privacy.epsilon`` of a private run, refused unless a finite number > 0; None if not private or if
    sigma is set directly (:func:`direct_noise_multiplier`: epsilon is then only reported)."""
    if not is_private(cfg.clip) or cfg.privacy.get("noise_multiplier") is not None:
        return None
    epsilon = cfg.privacy.epsilon
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(
            f"privacy.epsilon must be a finite number > 0, got {epsilon}; for a run without privacy use "
            "clip=nonprivate."
        )
    return float(epsilon)


def plan_run(
    cfg: DictConfig,
    sample_size: int,
    solve: Callable[..., float] = accounting.get_noise_multiplier,
    within_budget: Callable[..., int] = accounting.steps_within_budget,
    privacy_groups: torch.Tensor | None = None,
    calibrate_individual: Callable[..., tuple[float, individual.IndividualPrivacy]] = individual.calibrate,
) -> RunPlan:
    """Steps, sampling rate, delta and the noise multipliers: solved with :func:`calibration_accountant`
    (``solve`` has the signature of :func:`dpexp.privacy.accounting.get_noise_multiplier`), or, with
    ``noise.initial``, fixed and the run cut at the step where they spend the budget (``within_budget``:
    :func:`dpexp.privacy.accounting.steps_within_budget`). With ``privacy.individual``, ``privacy_groups``
    (N,) are the examples' groups and ``calibrate_individual`` (the signature of
    :func:`dpexp.privacy.individual.calibrate`) solves sigma and the groups' rates and scales."""
    check_run_keys(cfg)
    check_noise(cfg)
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
    direct = direct_noise_multiplier(cfg)
    noise = cfg.noise
    sigmas: list[float] = []
    stopped = False
    plan_individual = None
    variant = variant_of(cfg)
    if variant is not None:
        name, approximate = calibration_accountant(cfg)
        shape = schedule_shape(noise.name, steps, sample_rate, noise.rate, noise.period, noise.end_fraction)
        epsilons = [float(e) for e in cfg.privacy.individual.epsilons]
        if privacy_groups is None or privacy_groups.shape != (sample_size,):
            raise ValueError(
                f"privacy.individual: need the privacy group of each of the {sample_size} examples"
            )
        sizes = individual.group_sizes(privacy_groups, len(epsilons))
        try:
            scale, chosen = calibrate_individual(
                variant, epsilons, sizes, delta, batch_size, steps, accountant=name,
                shape=None if noise.name == "constant" else shape, allow_approximation=approximate,
            )  # fmt: skip
        except ValueError as error:
            raise ValueError(f"privacy.individual: {error}") from None
        sigmas = [scale * f for f in shape]
        epsilon = max(epsilons)
        plan_individual = {
            "variant": variant,
            "epsilons": epsilons,
            "group_sizes": sizes,
            "sample_rates": list(chosen.sample_rates),
            "scales": list(chosen.scales),
            "noise_multipliers": [scale / s for s in chosen.scales],
        }
    elif direct is not None:
        shape = schedule_shape(noise.name, steps, sample_rate, noise.rate, noise.period, noise.end_fraction)
        sigmas = [direct * f for f in shape]
    elif epsilon is not None:
        name, approximate = calibration_accountant(cfg)
        shape = schedule_shape(noise.name, steps, sample_rate, noise.rate, noise.period, noise.end_fraction)
        scale = noise.initial
        if scale is None:
            scale = solve(
                epsilon,
                delta,
                sample_rate,
                steps,
                accountant=name,
                allow_approximation=approximate,
                **({} if noise.name == "constant" else {"shape": shape}),
            )
        sigmas = [scale * f for f in shape]
        if noise.initial is not None:
            steps = _steps_until_spent(sigmas, sample_rate, delta, epsilon, name, within_budget, cfg)
            sigmas, stopped = sigmas[:steps], True
    return RunPlan(
        sample_size=sample_size,
        batch_size=batch_size,
        physical_batch_size=int(cfg.physical_batch_size),
        sample_rate=sample_rate,
        steps=steps,
        epochs=steps * sample_rate,
        delta=delta,
        target_epsilon=epsilon,
        noise_multiplier=sigmas[0] if sigmas else 0.0,
        noise_schedule=str(noise.name),
        noise_multipliers=sigmas,
        stopped_at_budget=stopped,
        individual=plan_individual,
    )


def _steps_until_spent(
    sigmas: list[float],
    sample_rate: float,
    delta: float,
    epsilon: float,
    accountant: str,
    within_budget: Callable[..., int],
    cfg: DictConfig,
) -> int:
    """Budget-based stopping: the number of steps of ``sigmas`` that spend at most ``epsilon``; refused when
    not even one step fits, or when the budget is not spent by the last allowed step."""
    steps = within_budget(sigmas, sample_rate, delta, epsilon, accountant=accountant)
    where = f"noise.initial={cfg.noise.initial} with noise={cfg.noise.name}"
    if steps == 0:
        raise ValueError(
            f"{where} spends more than privacy.epsilon={epsilon} in its first step: raise noise.initial."
        )
    if steps == len(sigmas):
        raise ValueError(
            f"{where} does not spend privacy.epsilon={epsilon} in the {steps} steps allowed (epochs/steps "
            "are the maximum when the run stops at its budget): raise epochs or steps, lower noise.initial, "
            "or set noise.initial=null to solve the schedule's scale for the budget."
        )
    return steps
