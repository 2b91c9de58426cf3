"""Entry point: ``python -m dpexp.train [group=option ...] [key=value ...]`` (Hydra; ``-m`` for sweeps).

Every key is checked against the schema of :mod:`dpexp.config` before training: an unknown key (appended
with ``+`` too), a value of the wrong type or an invalid choice fails at start-up with the valid ones; Hydra
itself lists the options of a config group (e.g. ``clip=foo``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpexp.config import ConfigError
from dpexp.privacy import accounting
from dpexp.training.loop import run_training

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the repository's conf/ (editable install)
GROUPS = ("task", "model", "clip", "accountant", "optim")
APPROXIMATION_LABELS = {"clt_approximation": "CLT approximation"}  # epsilon kinds that are not upper bounds


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
    if cfg.get("audit") is not None:
        raise ConfigError(
            "audit keys are for python -m dpexp.audit; python -m dpexp.train trains without canaries"
        )
    runtime = HydraConfig.get().runtime
    choices = {group: runtime.choices[group] for group in GROUPS if group in runtime.choices}
    record = run_training(cfg, runtime.output_dir, choices)
    print(summary(record))
    print(f"metrics: {runtime.output_dir}/metrics.json")


if __name__ == "__main__":
    main()
