"""The result store: config keys without run-local keys, seeds averaged, reruns counted once, other code
versions and unfinished runs kept apart; the code version; what a reproduce command does with each run."""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path

import pytest

from dpexp.reproduce import plan_runs
from dpexp.results import store
from dpexp.results.experiments import Point
from dpexp.runtime import code_version

CONFIG = {
    "seed": 0,
    "optim": {"name": "sgd", "lr": 0.5},
    "privacy": {"epsilon": 3.0, "accounting_timeout_s": 300},
    "output": {"root": "outputs"},
    "data": {"root": None},
    "resume": None,
    "device": "auto",
    "progress": True,
    "debug": False,
    "checkpoint": {"every": None},
}


def _with(config: dict, key: str, value) -> dict:
    out = json.loads(json.dumps(config))
    *parents, leaf = key.split(".")
    node = out
    for part in parents:
        node = node[part]
    node[leaf] = value
    return out


@pytest.mark.parametrize(
    "key,value",
    [("output.root", "elsewhere"), ("data.root", "../shared/data"), ("resume", "outputs/x"),
     ("device", "cuda"), ("progress", False), ("debug", True), ("checkpoint.every", 10),
     ("privacy.accounting_timeout_s", 10)],
)  # fmt: skip
def test_run_local_keys_do_not_change_the_config_key(key, value) -> None:
    assert store.config_key(_with(CONFIG, key, value)) == store.config_key(CONFIG)


@pytest.mark.parametrize("key,value", [("optim.lr", 0.25), ("privacy.epsilon", 8.0), ("seed", 1)])
def test_keys_of_the_computation_change_the_config_key(key, value) -> None:
    assert store.config_key(_with(CONFIG, key, value)) != store.config_key(CONFIG)


def test_kept_checkpoints_are_part_of_the_key_only_when_set() -> None:
    """checkpoint.at_epochs (he2023_figure2's checkpoints) makes another run; null or [] is the key of a
    config that predates the option, so no older record changes key."""
    kept = _with(CONFIG, "checkpoint.at_epochs", [0.0, 1.0])
    assert store.config_key(_with(CONFIG, "checkpoint.at_epochs", None)) == store.config_key(CONFIG)
    assert store.config_key(_with(CONFIG, "checkpoint.at_epochs", [])) == store.config_key(CONFIG)
    assert store.config_key(kept) != store.config_key(CONFIG)
    assert store.config_key(kept, with_seed=False) != store.config_key(CONFIG, with_seed=False)
    assert store.config_key(_with(kept, "checkpoint.every", 5)) == store.config_key(kept)  # still run-local
    assert store.config_key(_with(kept, "checkpoint.at_epochs", [0.0, 2.0])) != store.config_key(kept)


def test_model_metrics_are_part_of_the_key_only_when_set() -> None:
    """task.model_metrics came after DART and E2E records existed: null hashes as a record without it."""
    task = {"task": {"_target_": "dpexp.tasks.dart.DARTTask", "num_beams": 5}}
    older = {**CONFIG, **task}
    assert store.config_key(_with(older, "task.model_metrics", None)) == store.config_key(older)
    asked = _with(older, "task.model_metrics", {"bertscore": "bertscore"})
    assert store.config_key(asked) != store.config_key(older)
    assert store.config_key(_with(CONFIG, "model_metrics", None)) != store.config_key(CONFIG)  # only task's


def test_a_text_encoders_head_start_is_part_of_the_key_only_when_not_random() -> None:
    """model.head_init and model.head_scale came after the SST-2 records existed (stop 76): at their defaults
    (random, 5.0) a config hashes as a record without them, so those records stay the current grid's runs of
    older code (flagged, not "not run"); a head started at the label prompts is another run."""
    older = {**CONFIG, "model": {"name": "minilm", "pooling": "mean", "dropout": 0.1}}
    current = _with(_with(older, "model.head_init", "random"), "model.head_scale", 5.0)
    assert store.config_key(current) == store.config_key(older)
    assert store.config_key(current, with_seed=False) == store.config_key(older, with_seed=False)
    prompts = _with(current, "model.head_init", "label_prompts")
    assert store.config_key(prompts) != store.config_key(older)
    assert store.config_key(_with(prompts, "model.head_scale", 10.0)) != store.config_key(prompts)


def test_the_setting_key_ignores_only_the_seed() -> None:
    assert store.config_key(_with(CONFIG, "seed", 7), with_seed=False) == store.config_key(
        CONFIG, with_seed=False
    )
    assert store.config_key(_with(CONFIG, "optim.lr", 0.1), with_seed=False) != store.config_key(
        CONFIG, with_seed=False
    )


def _entry(run_dir: str, seed: int, value: float | None, status: str = "completed", code: str = "new"):
    config = _with(CONFIG, "seed", seed)
    return {
        "run_dir": run_dir,
        "status": status,
        "run_key": store.config_key(config),
        "setting_key": store.config_key(config, with_seed=False),
        "seed": seed,
        "source_hash": code,
        "metrics": {"accuracy": value},
    }


def test_summary_averages_seeds_once_each_and_keeps_other_runs_apart() -> None:
    entries = [
        _entry("a", 0, 0.90),
        _entry("b", 1, 0.92),
        _entry("c", 2, 0.97),
        _entry("d", 0, 0.10),  # a rerun of seed 0 by the same code: the same run, counted once
        _entry("e", 1, 0.50, code="old"),  # an older code version: flagged, not mixed
        _entry("f", 2, None, status="failed"),
        _entry("g", 2, math.nan, status="diverged"),
        _entry("h", 1, 0.91, status="interrupted"),
    ]
    key = entries[0]["setting_key"]
    summary = store.summarize(entries, key, "accuracy", "new")
    assert summary.values == [0.90, 0.92, 0.97] and summary.seeds == [0, 1, 2]
    assert summary.mean == pytest.approx(0.93)
    assert summary.std == pytest.approx(math.sqrt(((0.03) ** 2 + 0.01**2 + 0.04**2) / 2))
    assert list(summary.older) == ["old"] and summary.older["old"].values == [0.50]
    assert dict(summary.statuses) == {"failed": 1, "diverged": 1, "interrupted": 1}
    single = store.summarize(entries[:1], key, "accuracy", "new")
    assert single.n == 1 and single.std is None  # no std from one seed


def _write_run(folder: Path, record: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(record))
    return folder


def test_index_reads_every_record_and_round_trips(tmp_path: Path) -> None:
    code = {"source_hash": "abc", "commit": "1234", "dirty": False}
    base = {"metric_names": ["accuracy"], "accuracy": 0.9, "seed": 0, "config": CONFIG}
    machine = {"cpu": "Xeon", "cpu_capability": "AVX512", "torch": "2.14.1", "gpu": None}
    _write_run(
        tmp_path / "s" / "b", {**base, "status": "completed", "code_version": code, "machine": machine}
    )
    legacy = {k: v for k, v in base.items() if k != "config"}  # an old record: config only in .hydra
    run = _write_run(tmp_path / "s" / "a", {**legacy, "status": "failed", "accuracy": "NaN"})
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(json.dumps(CONFIG))  # JSON is YAML
    entries = store.scan(tmp_path)
    assert [Path(e["run_dir"]).name for e in entries] == ["a", "b"]
    assert entries[0]["source_hash"] == store.UNKNOWN_CODE and entries[1]["source_hash"] == "abc"
    assert entries[0]["machine"] is None and entries[1]["machine"] == machine  # kept, not part of the keys
    assert store.summarize(entries, entries[1]["setting_key"], "accuracy", "abc").machines == {
        "Xeon (AVX512), torch 2.14.1": 1
    }
    assert entries[0]["run_key"] == entries[1]["run_key"] == store.config_key(CONFIG)
    assert math.isnan(entries[0]["metrics"]["accuracy"]) and entries[1]["metrics"]["accuracy"] == 0.9
    store.write_index(entries, tmp_path / "index.jsonl")
    assert store.read_index(tmp_path / "index.jsonl") == json.loads(json.dumps(entries))


def test_the_index_keeps_the_epsilon_of_every_accountant_as_a_metric(tmp_path: Path) -> None:
    """Li et al. Table 7 prints a run's epsilon under GDP (CLT) and numerical composition beside its
    metrics: the index offers epsilon_<accountant> like the task's metrics (infinite: not a number)."""
    epsilon = {"rdp": 3.0, "prv": 2.6, "gdp": 2.3}
    record = {
        "metric_names": ["bleu"],
        "bleu": 61.5,
        "epsilon": epsilon,
        "status": "completed",
        "config": CONFIG,
    }
    _write_run(tmp_path / "dp", record)
    _write_run(
        tmp_path / "np", {**record, "epsilon": {"rdp": "Infinity", "prv": "Infinity", "gdp": "Infinity"}}
    )
    private, nonprivate = (store.scan(tmp_path)[i]["metrics"] for i in (0, 1))
    assert private == {"bleu": 61.5, "epsilon_rdp": 3.0, "epsilon_prv": 2.6, "epsilon_gdp": 2.3}
    assert math.isinf(nonprivate["epsilon_gdp"])
    summary = store.summarize(
        store.scan(tmp_path), store.config_key(CONFIG, with_seed=False), "epsilon_gdp", "?"
    )
    assert {code: s.values for code, s in summary.older.items()} == {store.UNKNOWN_CODE: [2.3]}  # no inf


def test_a_running_record_is_running_only_while_its_process_holds_the_lock(tmp_path: Path) -> None:
    """The index (and with it reproduce's plan and the tables' counts) calls a record that says running
    killed unless a process holds its run directory's lock: a table must not count a dead run as running."""
    run = _write_run(tmp_path / "r", {"status": "running", "config": CONFIG})
    assert store.scan(tmp_path)[0]["status"] == "killed"  # no lock file: nobody ever held it here
    (run / ".lock").touch()
    assert store.scan(tmp_path)[0]["status"] == "killed"  # nobody holds it
    descriptor = os.open(run / ".lock", os.O_RDWR)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert store.scan(tmp_path)[0]["status"] == "running"
    finally:
        os.close(descriptor)
    assert store.scan(tmp_path)[0]["status"] == "killed"


def test_plan_skips_complete_runs_resumes_unfinished_ones_and_reruns_older_code() -> None:
    points = [
        Point("x", "offline", (f"seed={seed}",), (("seed", str(seed)),), ("seed",)) for seed in range(7)
    ]
    keys = {point: store.config_key(_with(CONFIG, "seed", i)) for i, point in enumerate(points)}
    entries = [
        _entry("runs/0", 0, 0.9),
        _entry("runs/1", 1, None, status="interrupted"),
        _entry("runs/2", 2, 0.9, code="old"),
        _entry("runs/3", 3, None, status="diverged"),
        _entry("runs/5", 5, None, status="killed"),
        _entry("runs/6", 6, None, status="running"),
    ]
    plan = plan_runs(points, keys, entries, "new")
    assert plan.skip == [points[0]]
    assert plan.resume == [(points[1], "runs/1"), (points[5], "runs/5")]
    assert plan.launch == [points[2], points[4]]  # older code's run is not this code's: run again
    assert plan.blocked == [(points[3], "diverged"), (points[6], "running")]


def test_code_version_hashes_the_package_but_not_the_readers_of_records(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "results").mkdir(parents=True)
    (package / "train.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    first = code_version(package)
    assert first["commit"] is None and first["dirty"] is None  # not a git checkout
    (package / "results" / "tables.py").write_text("y = 2\n")
    (package / "reproduce.py").write_text("z = 3\n")
    assert code_version(package) == first
    (package / "train.py").write_text("x = 2\n")
    assert code_version(package)["source_hash"] != first["source_hash"]
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'a'\n")
    assert len({code_version(package)["source_hash"], first["source_hash"]}) == 2


def test_the_repository_code_version_names_its_commit() -> None:
    version = code_version()
    assert len(version["commit"]) == 40 and isinstance(version["dirty"], bool)
