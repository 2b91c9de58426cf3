"""``python -m dpexp.bench [bench_suite=...] [key=value ...]`` (Hydra, ``conf/bench.yaml``)."""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from dpexp.bench.suite import run_suite
from dpexp.config import composition_refusals

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/ (editable install)


@hydra.main(config_path=str(CONF_DIR), config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_suite(cfg)


if __name__ == "__main__":
    with composition_refusals(exit_code=1):
        main()
