"""Shared test fixtures: repository paths and Hydra composition of ``conf/config.yaml``."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import dpexp.train  # registers the config schema  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only the tests whose node id hashes to I modulo N (make test: N = 2 processes at once)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "shard_together(name): the tests of this name run in one --shard, so that the costly module fixture "
        "they share is made once (not once in every process)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--shard=I/N`` keeps the tests whose node id hashes to I modulo N: N processes, I = 0..N-1, together
    run each test exactly once (by its name, whatever order each process collects in), every module's costly
    tests spread over them. Tests marked ``shard_together(name)`` hash by that name instead."""
    shard = config.getoption("--shard")
    if shard is None:
        return
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"--shard={shard}: expected I/N with 0 <= I < N, e.g. --shard=0/2")
    kept, deselected = [], []
    for item in items:
        marker = item.get_closest_marker("shard_together")
        key = f"shard_together:{marker.args[0]}" if marker else item.nodeid
        (kept if zlib.crc32(key.encode()) % int(count) == int(index) else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept


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


@pytest.fixture
def compose_config() -> Callable[[Sequence[str]], DictConfig]:
    """``compose_config(overrides)`` -> ``conf/config.yaml`` composed as ``python -m dpexp.train`` does."""

    def _compose(overrides: Sequence[str] = ()) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="config", overrides=list(overrides))

    return _compose


@pytest.fixture
def without_meteor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluations leave METEOR out, as on a machine without Java: its scorer starts a JVM that loads
    Meteor's paraphrase tables, seconds per evaluation. For tests of a training path, not of the metrics
    (tests/test_metrics_text.py and each generation task's evaluation test score METEOR)."""
    from dpexp.metrics import text

    monkeypatch.setattr(text, "java_available", lambda: False)


def composed_group(group: str, option: str) -> DictConfig:
    """One option of a config group as it is composed (its ``defaults`` merged), outside a test."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=[f"{group}={option}"])[group]
