"""Optimizers and learning-rate schedules from the ``optim`` config group.

The privacy backends wrap the optimizer built here; the schedule is attached to this (inner) optimizer, whose
``param_groups`` the wrappers share, so it works the same for every backend. Noise and clipping happen before
the optimizer sees the gradient, so DP-SGD, DP-Adam and DP-AdamW are these optimizers fed privatised
gradients (Li et al. 2022, app. A).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from dpexp.config import ConfigError
from dpexp.training.adadp import ADADP


def _adam_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "lr": cfg["lr"],
        "betas": tuple(cfg.get("betas", (0.9, 0.999))),
        "eps": cfg.get("eps", 1e-8),
        "weight_decay": cfg.get("weight_decay", 0.0),
    }


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, cfg: torch.optim.SGD(
        params, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0), weight_decay=cfg.get("weight_decay", 0.0)
    ),
    "adam": lambda params, cfg: torch.optim.Adam(params, **_adam_options(cfg)),
    "adamw": lambda params, cfg: torch.optim.AdamW(params, **_adam_options(cfg)),
    "adadp": lambda params, cfg: ADADP(
        params,
        lr=cfg["lr"],
        tolerance=cfg["tolerance"],
        alpha_min=cfg.get("alpha_min", 0.9),
        alpha_max=cfg.get("alpha_max", 1.1),
    ),
}


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim_cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """The torch optimizer named ``optim_cfg["name"]`` (sgd | adam | adamw | adadp) over ``params``."""
    name = optim_cfg["name"]
    if name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {name!r}; valid choices: {', '.join(OPTIMIZERS)}.")
    check_optim_values(optim_cfg)
    return OPTIMIZERS[name](list(params), optim_cfg)


def check_optim_values(optim_cfg: Mapping[str, Any]) -> None:
    """Refuse values torch would refuse with a message that does not name the key (or would accept: an
    infinite learning rate), naming ``optim.<key>`` and the range."""
    lr = optim_cfg["lr"]
    if not (math.isfinite(lr) and lr >= 0):
        raise ConfigError(f"optim.lr must be a finite number >= 0, got {lr}; e.g. optim.lr=0.1 for sgd.")
    for key in ("momentum", "weight_decay", "eps"):
        value = optim_cfg.get(key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"optim.{key} must be a finite number >= 0, got {value}.")
    if optim_cfg["name"] == "adadp":
        tolerance, low, high = (optim_cfg.get(k) for k in ("tolerance", "alpha_min", "alpha_max"))
        if tolerance is None or not (math.isfinite(tolerance) and tolerance > 0):
            raise ConfigError(f"optim.tolerance (tau of ADADP) must be a finite number > 0, got {tolerance}.")
        if not (low is not None and high is not None and 0 < low < 1 < high < math.inf):
            raise ConfigError(f"ADADP needs 0 < optim.alpha_min < 1 < optim.alpha_max, got {low} and {high}.")
    betas = optim_cfg.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0 <= beta < 1 for beta in betas)):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(betas)}.")


def lr_factor(schedule: str, step: int, total_steps: int, warmup_fraction: float = 0.0) -> float:
    """Multiplier of the peak learning rate before update ``step`` (0-based) of ``total_steps``.

    constant: 1. linear_warmup_decay: W = round(warmup_fraction * T) warm-up steps rising linearly to 1
    ((step + 1) / W), then linear decay reaching 0 after the last step ((T - step) / (T - W)).
    """
    if schedule == "constant":
        return 1.0
    if schedule == "linear_warmup_decay":
        warmup = round(warmup_fraction * total_steps)
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))
    raise ValueError(f"Unknown schedule {schedule!r}; valid choices: constant, linear_warmup_decay.")


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule_cfg: Mapping[str, Any], total_steps: int
) -> LambdaLR:
    """A per-step ``LambdaLR`` following :func:`lr_factor`; call ``.step()`` after each optimizer step."""
    name = schedule_cfg["name"]
    warmup_fraction = float(schedule_cfg.get("warmup_fraction", 0.0))
    if not 0.0 <= warmup_fraction < 1.0:
        raise ConfigError(f"optim.schedule.warmup_fraction must be in [0, 1), got {warmup_fraction}.")
    lr_factor(name, 0, total_steps, warmup_fraction)  # fail now on an unknown schedule name
    return LambdaLR(optimizer, lambda step: lr_factor(name, step, total_steps, warmup_fraction))


def effective_lr(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> float:
    """The step size of the first parameter group: the schedule's lr, times ADADP's adapted scale."""
    return scheduler.get_last_lr()[0] * optimizer.param_groups[0].get("lr_scale", 1.0)


def optimizer_report(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What an adaptive optimizer decided so far, for the run record: ADADP's iterations (two steps each),
    accepted ones and step-size scale; empty for the others."""
    group = optimizer.param_groups[0] if optimizer is not None else {}
    if "lr_scale" not in group:
        return {}
    return {"adadp": {key: group[key] for key in ("iterations", "accepted", "lr_scale")}}
