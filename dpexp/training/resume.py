"""Continuing a run: ``python -m dpexp.train resume=<run dir>``.

The run goes on in its own directory with its own config, as its metrics.json records it; beside ``resume``
the command line may only set what does not change the run (:data:`RUNTIME_KEYS`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dpexp.config import ConfigError
from dpexp.training.record import METRICS_FILE, RunDirectoryError

RUNTIME_KEYS = (
    "resume",
    "device",
    "progress",
    "checkpoint",
    "logger",
    "wandb",
    "debug",
    "privacy.accounting_memory_gib",
    "privacy.accounting_timeout_s",
)


def load_run_config(run_dir: str | os.PathLike) -> DictConfig:
    """The config a run recorded in ``run_dir/metrics.json``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise RunDirectoryError(f"resume={run_dir}: no {METRICS_FILE} there, so no run to continue.")
    return OmegaConf.create(json.loads(path.read_text())["config"])


def resumed_config(run_dir: str | os.PathLike, cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """The config of the run in ``run_dir`` with the runtime keys that the command line set (``overrides``:
    Hydra's ``key=value`` strings) taken from ``cfg``, the composed config; other overrides are refused.
    Top-level keys the run's config lacks (added to dpexp after it started) take their defaults from
    ``cfg``."""
    saved = load_run_config(run_dir)
    keys = [override.split("=", 1)[0].lstrip("+~") for override in overrides]
    refused = [key for key in keys if not _is_runtime(key)]
    if refused:
        raise ConfigError(
            f"resume={run_dir} continues that run with its own config, which {', '.join(refused)} would "
            f"change; beside resume only {', '.join(RUNTIME_KEYS[1:])} may be set. Start a new run instead."
        )
    for key in keys:
        if key != "resume":
            OmegaConf.update(saved, key, OmegaConf.select(cfg, key), force_add=True)
    for key in set(cfg) - set(saved):  # a top-level key added since the run started: its default did the same
        saved[key] = cfg[key]
    return saved


def _is_runtime(key: str) -> bool:
    return any(key == runtime or key.startswith(f"{runtime}.") for runtime in RUNTIME_KEYS)
