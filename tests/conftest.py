"""Shared test fixtures: repository paths and Hydra composition of ``conf/config.yaml``."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import dpexp.train  # registers the config schema  # noqa: F401

# --shard=I/N and --record-durations (make test, make test-durations): pytest reads hooks from this namespace
from tests.sharding import pytest_addoption, pytest_collection_modifyitems, pytest_configure  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# Record fields that depend on the clock or on how a run was split into sessions: a resumed run's record
# equals an uninterrupted one's without them
TIMING_FIELDS = frozenset(
    {"throughput_examples_per_s", "train_time_s", "wall_time_s", "peak_memory_bytes", "resumes", "started_at"}
)


def stable_record(record: dict) -> dict:
    """A run record without what depends on the clock or on how the run was split into sessions."""
    history = [{k: v for k, v in h.items() if k != "train_time_s"} for h in record["history"]]
    return {k: v for k, v in record.items() if k not in TIMING_FIELDS} | {"history": history}


# A run of a few seconds: three steps, no progress bar, evaluation only at the end.
TINY_RUN = ("steps=3", "progress=false", "eval_every=null", "batch_size=32", "physical_batch_size=16")


def composed(overrides: Sequence[str] = ()) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides`` as ``python -m dpexp.train`` composes it: once per
    process and overrides (Hydra takes ~0.5 s a composition, and many tests compose the same run), a copy of
    its own to each caller. A composition that fails raises each time (errors are not kept)."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def compose_config() -> Callable[[Sequence[str]], DictConfig]:
    """``compose_config(overrides)`` -> ``conf/config.yaml`` composed as ``python -m dpexp.train`` does."""
    return composed


@pytest.fixture
def without_meteor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluations leave METEOR out, as on a machine without Java: its scorer starts a JVM that loads
    Meteor's paraphrase tables, seconds per evaluation. For tests of a training path, not of the metrics
    (tests/test_metrics_text.py and each generation task's evaluation test score METEOR)."""
    from dpexp.metrics import text

    monkeypatch.setattr(text, "java_available", lambda: False)


def composed_group(group: str, option: str) -> DictConfig:
    """One option of a config group as it is composed (its ``defaults`` merged), outside a test (test modules
    choose their parameters by it when collected)."""
    return composed([f"{group}={option}"])[group]
