"""Entry point: ``python -m dpexp.train [group=option ...] [key=value ...]`` (Hydra; ``-m`` for sweeps).

The structured schema below types the top-level keys of ``conf/config.yaml``: an unknown key, a value of the
wrong type or an invalid choice (e.g. ``sampling=foo``) fails at start-up with the valid choices; Hydra itself
lists the options of a config group (e.g. ``clip=foo``). The groups' own keys are checked by the code that
consumes them (:mod:`dpexp.backends`, :mod:`dpexp.training.optim`, :mod:`dpexp.privacy.accounting`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from dpexp.privacy import accounting
from dpexp.training.loop import run_training

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the repository's conf/ (editable install)
GROUPS = ("task", "model", "clip", "accountant", "optim")
APPROXIMATION_LABELS = {"clt_approximation": "CLT approximation"}  # epsilon kinds that are not upper bounds


class Sampling(str, Enum):
    poisson = "poisson"
    shuffle = "shuffle"


class Logger(str, Enum):
    none = "none"
    wandb = "wandb"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class PrivacySchema:
    epsilon: float = MISSING
    delta: float | None = MISSING
    delta_rule: str = MISSING  # a key of dpexp.privacy.accounting.DELTA_RULES


@dataclass
class WandbSchema:
    project: str = MISSING
    entity: str | None = MISSING
    mode: WandbMode = MISSING


@dataclass
class DataSchema:
    root: str | None = MISSING


@dataclass
class OutputSchema:
    root: str = MISSING


@dataclass
class Schema:
    """Types of ``conf/config.yaml``; the values and their documentation live in the YAML."""

    task: Any = MISSING
    model: Any = MISSING
    clip: Any = MISSING
    accountant: Any = MISSING
    optim: Any = MISSING
    seed: int = MISSING
    privacy: PrivacySchema = field(default_factory=PrivacySchema)
    epochs: float | None = MISSING
    steps: int | None = MISSING
    batch_size: int = MISSING
    physical_batch_size: int = MISSING
    group_by_length: bool = MISSING
    sampling: Sampling = MISSING
    eval_every: int | None = MISSING
    eval_batch_size: int = MISSING
    device: str = MISSING
    progress: bool = MISSING
    log_every: int = MISSING
    logger: Logger = MISSING
    wandb: WandbSchema = field(default_factory=WandbSchema)
    data: DataSchema = field(default_factory=DataSchema)
    output: OutputSchema = field(default_factory=OutputSchema)


ConfigStore.instance().store(name="dpexp_schema", node=Schema)


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse top-level keys the schema does not know (Hydra lets ``+key=value`` append them)."""
    known = {f.name for f in fields(Schema)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"Unknown config keys {unknown}; valid top-level keys: {', '.join(sorted(known))}.")


def _epsilon_text(name: str, value: float, kind: str) -> str:
    """``rdp=2.998`` for an upper bound, ``gdp≈2.535 (CLT approximation)`` for an approximation."""
    if kind == accounting.UPPER_BOUND:
        return f"{name}={value:.3f}"
    return f"{name}≈{value:.3f} ({APPROXIMATION_LABELS[kind]})"


def summary(record: dict[str, Any]) -> str:
    """A few lines for the terminal: task metrics, epsilon, throughput, peak memory, where metrics.json is."""
    metrics = ", ".join(f"{name}={record[name]:.4f}" for name in record.get("metric_names", []))
    epsilon, kinds = record.get("epsilon", {}), record.get("epsilon_kind", {})
    eps = (
        ", ".join(_epsilon_text(k, v, kinds[k]) for k, v in epsilon.items() if v is not None) or "non-private"
    )
    return (
        f"{record['task']} / {record['model']} / {record['clip']}: {metrics}\n"
        f"epsilon ({eps}) at delta={record['delta']:.3g}, sigma={record['noise_multiplier']:.4f}, "
        f"{record['steps']} steps ({record['epochs']:.2f} epochs)\n"
        f"throughput {record['throughput_examples_per_s']:.1f} examples/s, "
        f"peak memory {record['peak_memory_bytes'] / 2**20:.1f} MiB ({record['peak_memory_kind']}), "
        f"wall time {record['wall_time_s']:.1f} s"
    )


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    """Run one configuration and print its summary."""
    check_known_keys(cfg)
    runtime = HydraConfig.get().runtime
    choices = {group: runtime.choices[group] for group in GROUPS if group in runtime.choices}
    record = run_training(cfg, runtime.output_dir, choices)
    print(summary(record))
    print(f"metrics: {runtime.output_dir}/metrics.json")


if __name__ == "__main__":
    main()
