"""Individualized privacy in a run (``privacy.individual``; IDP-SGD, Boenisch et al. 2023, Monir et al. 2024
section 5 and Tables 9-10): the config checked before any data loads, every training example's privacy group
(a seeded split by fractions, or a task column), and the plan's individual part back as the engine's
:class:`~dpexp.privacy.individual.IndividualPrivacy`. The calibration itself is
:func:`dpexp.privacy.individual.calibrate` (called by :func:`dpexp.training.plan.plan_run`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from dpexp.backends import method_of
from dpexp.config import ConfigError
from dpexp.privacy.individual import VARIANTS, IndividualPrivacy, assign_by_fractions, check_group_indices
from dpexp.tasks.base import Task

KEY = "privacy.individual"


def variant_of(cfg: DictConfig) -> str | None:
    """``privacy.individual.variant`` (sampling | scaling), None when it is ``none`` (or absent: the config of
    a run recorded before the key existed, resumed)."""
    variant = str(OmegaConf.select(cfg, "privacy.individual.variant", default="none"))
    return None if variant == "none" else variant


def check_individual(cfg: DictConfig) -> None:
    """Refuse a ``privacy.individual`` that cannot work, naming the key, before any data loads."""
    node = OmegaConf.select(cfg, KEY)
    if node is None:  # a run recorded before the key existed, resumed
        return
    variant = str(node.variant)
    if variant not in ("none", *VARIANTS):
        raise ConfigError(f"{KEY}.variant must be none, sampling or scaling, got {variant!r}.")
    given = [key for key in ("epsilons", "fractions", "column") if node[key] is not None]
    if variant == "none":
        if given:
            raise ConfigError(
                f"{KEY}.{given[0]} is set but {KEY}.variant=none: choose sampling or scaling, or unset it."
            )
        return
    epsilons = node.epsilons
    if not epsilons or not all(e > 0 and math.isfinite(e) for e in epsilons):
        raise ConfigError(
            f"{KEY}.epsilons must list every privacy group's budget, finite numbers > 0 (e.g. [1.0, 2.0, "
            f"3.0], the survey's Table 9 case 1); got {_plain(epsilons)}."
        )
    if (node.fractions is None) == (node.column is None):
        raise ConfigError(
            f"{KEY}: give either fractions (a seeded split, e.g. [0.34, 0.43, 0.23]) or column (a task "
            "column of group indices), not both or neither."
        )
    fractions = node.fractions
    if fractions is not None and (
        len(fractions) != len(epsilons)
        or not all(0 < f <= 1 for f in fractions)
        or abs(sum(fractions) - 1) > 1e-6
    ):
        raise ConfigError(
            f"{KEY}.fractions must give one share in (0, 1] per group of {KEY}.epsilons "
            f"({len(epsilons)}), summing to 1; got {_plain(fractions)}."
        )
    method = method_of(cfg.clip)
    if method != "dpexp":
        raise ConfigError(f"{KEY} needs a dpexp clip (e.g. clip=bk or clip=ghost), not clip.method={method}.")
    if cfg.noise.initial is not None:
        raise ConfigError(
            f"{KEY} calibrates every group's noise for its budget: set noise.initial=null (budget-based "
            "stopping is for one budget)."
        )
    if variant == "sampling" and str(getattr(cfg.sampling, "value", cfg.sampling)) != "poisson":
        raise ConfigError(
            f"{KEY}.variant=sampling samples each group at its own Poisson rate: use sampling=poisson."
        )
    if variant == "scaling" and OmegaConf.select(cfg, "clip.engine.adaptive") is not None:
        raise ConfigError(
            f"{KEY}.variant=scaling clips each group at its own bound, which adaptive thresholds do not "
            "account for: use fixed thresholds (e.g. clip=bk, clip=perlayer), or variant=sampling."
        )


def privacy_groups(cfg: DictConfig, task: Task, dataset: Dataset) -> torch.Tensor | None:
    """Every training example's privacy group (N,), or None without individualized privacy: a random split
    by ``fractions`` seeded by ``seed``, or the task's ``column`` (group indices in [0, G))."""
    if variant_of(cfg) is None:
        return None
    node = cfg.privacy.individual
    num_groups = len(node.epsilons)
    if node.fractions is not None:
        return assign_by_fractions(len(dataset), list(node.fractions), int(cfg.seed))
    values = [task.column_value(dataset[i], str(node.column)) for i in range(len(dataset))]
    if not all(isinstance(v, int) or (torch.is_tensor(v) and v.numel() == 1) for v in values):
        raise ConfigError(f"{KEY}.column={node.column}: its values must be integer group indices.")
    groups = torch.tensor([int(v) for v in values], dtype=torch.long)
    try:
        check_group_indices(groups, num_groups)
    except ValueError:
        raise ConfigError(
            f"{KEY}.column={node.column} holds values in [{int(groups.min())}, {int(groups.max())}], but "
            f"{KEY}.epsilons has {num_groups} groups: it must hold group indices in [0, {num_groups})."
        ) from None
    return groups


def individual_of(individual: Mapping[str, Any] | None) -> IndividualPrivacy | None:
    """The engine's :class:`IndividualPrivacy` from the plan's ``individual`` field (None: none)."""
    if individual is None:
        return None
    return IndividualPrivacy(
        individual["variant"], tuple(individual["sample_rates"]), tuple(individual["scales"])
    )


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
