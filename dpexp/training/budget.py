"""The accountants' answers a run needs, computed under limits: sigma for the target epsilon, and the epsilon
spent after so many steps under every accountant. Each answer comes from a child process that may map at
most ``privacy.accounting_memory_gib`` more memory and run ``privacy.accounting_timeout_s`` seconds
(:mod:`dpexp.training.bounded`): at a huge epsilon the PRV accountant's grid needs tens of GB, and that
accountant is then reported as failed, with the reason, instead of killing the run."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from dpexp.config import ConfigError
from dpexp.privacy import accounting, individual
from dpexp.training.bounded import BoundedCalls, Limits
from dpexp.training.individual import individual_of
from dpexp.training.plan import RunPlan

MEMORY_KEY = "privacy.accounting_memory_gib"
TIMEOUT_KEY = "privacy.accounting_timeout_s"

log = logging.getLogger(__name__)


def accounting_limits(privacy: DictConfig) -> Limits:
    """The limits of every accountant call, from the ``privacy`` config node."""
    memory, timeout = privacy.accounting_memory_gib, privacy.accounting_timeout_s
    for key, value in ((MEMORY_KEY, memory), (TIMEOUT_KEY, timeout)):
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{key} must be a positive number, got {value}.")
    return Limits(int(memory * 2**30), float(timeout), MEMORY_KEY, TIMEOUT_KEY)


class PrivacyBudget:
    """The run's accountant calls under ``limits``; epsilons are remembered by (accountant, steps). Close it
    (or use it as a context manager) to end the child process."""

    def __init__(self, limits: Limits) -> None:
        self._calls = BoundedCalls(limits)
        self._epsilons: dict[tuple[str, int, int | None], float] = {}

    def __enter__(self) -> PrivacyBudget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._calls.close()

    def noise_multiplier(self, *args: Any, accountant: str, **kwargs: Any) -> float:
        """:func:`dpexp.privacy.accounting.get_noise_multiplier` under the limits."""
        return self._calls(
            accounting.get_noise_multiplier,
            *args,
            accountant=accountant,
            what=f"calibrating sigma with the {accountant} accountant",
            **kwargs,
        )

    def steps_within_budget(self, *args: Any, accountant: str, **kwargs: Any) -> int:
        """:func:`dpexp.privacy.accounting.steps_within_budget` under the limits."""
        return self._calls(
            accounting.steps_within_budget,
            *args,
            accountant=accountant,
            what=f"the steps within the budget under the {accountant} accountant",
            **kwargs,
        )

    def calibrate_individual(self, *args: Any, accountant: str, **kwargs: Any) -> Any:
        """:func:`dpexp.privacy.individual.calibrate` under the limits."""
        return self._calls(
            individual.calibrate,
            *args,
            accountant=accountant,
            what=f"calibrating the privacy groups with the {accountant} accountant",
            **kwargs,
        )

    def epsilon(self, plan: RunPlan, sigmas: Sequence[float], accountant: str) -> float | None:
        """Epsilon of steps at noise multipliers ``sigmas``, those accounted so far (None for a non-private
        run, 0 before the first step, inf with a sigma of 0); remembered by their number, which only grows
        during a run. With individualized privacy the largest group's (:meth:`group_epsilons`): the guarantee
        every example has."""
        if plan.individual is not None:
            return max(self.group_epsilons(plan, sigmas, accountant))
        if not plan.noise_multipliers:  # non-private
            return None
        if not sigmas:
            return 0.0
        key = (accountant, len(sigmas), None)
        if key not in self._epsilons:
            self._epsilons[key] = self._calls(
                accounting.get_schedule_epsilon,
                list(sigmas),
                plan.sample_rate,
                plan.delta,
                accountant=accountant,
                what=f"epsilon under the {accountant} accountant",
            )
        return self._epsilons[key]

    def group_epsilons(self, plan: RunPlan, sigmas: Sequence[float], accountant: str) -> list[float]:
        """Epsilon of every privacy group after steps at ``sigmas`` (individualized privacy: group g's steps
        at rate q_g and noise multipliers sigma_t / s_g)."""
        chosen = individual_of(plan.individual)
        if not sigmas:
            return [0.0] * chosen.num_groups
        for g in range(chosen.num_groups):
            key = (accountant, len(sigmas), g)
            if key not in self._epsilons:
                self._epsilons[key] = self._calls(
                    chosen.group_epsilon,
                    list(sigmas),
                    plan.delta,
                    accountant,
                    g,
                    what=f"epsilon of privacy group {g} under the {accountant} accountant",
                )
        return [self._epsilons[(accountant, len(sigmas), g)] for g in range(chosen.num_groups)]

    def epsilons(
        self, plan: RunPlan, sigmas: Sequence[float]
    ) -> tuple[dict[str, float | None], dict[str, str]]:
        """Epsilon under every accountant, and the error of each one that failed (its epsilon is None)."""
        return self._every_accountant(lambda name: self.epsilon(plan, sigmas, name))

    def epsilons_by_group(
        self, plan: RunPlan, sigmas: Sequence[float]
    ) -> tuple[dict[str, list[float] | None], dict[str, str]]:
        """Every privacy group's epsilon under every accountant, and the errors (individualized privacy)."""
        return self._every_accountant(lambda name: self.group_epsilons(plan, sigmas, name))

    @staticmethod
    def _every_accountant(compute: Any) -> tuple[dict[str, Any], dict[str, str]]:
        epsilons: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name in accounting.ACCOUNTANTS:
            try:
                epsilons[name] = compute(name)
            except (ValueError, RuntimeError, ArithmeticError) as error:
                epsilons[name] = None
                errors[name] = f"{type(error).__name__}: {error}"
                log.warning("epsilon under the %s accountant failed: %s", name, error)
        return epsilons, errors
