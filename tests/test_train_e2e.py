"""``python -m dpexp.train`` end to end: the default run for a few steps, a sweep, reproducibility."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dpexp.training.loop import run_training
from tests.conftest import REPO_ROOT, TINY_RUN, stable_record


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dpexp.train", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_default_run_for_a_few_steps(tmp_path):
    result = _train("steps=3", "eval_every=2", "progress=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "metrics.json").read_text())
    required = {
        "task", "model", "clip", "accountant", "noise_multiplier", "epsilon", "delta", "sample_rate", "steps",
        "epochs", "batch_size", "physical_batch_size", "accuracy", "throughput_examples_per_s",
        "peak_memory_bytes", "wall_time_s", "status", "config", "history",
    }  # fmt: skip
    assert required <= set(data), required - set(data)
    assert [data[k] for k in ("task", "model", "accountant")] == ["digits", "small_cnn", "rdp"]
    assert data["clip"] == data["config"]["clip"]["name"]
    assert data["status"] == "completed" and data["steps"] == 3
    assert set(data["epsilon"]) == {"rdp", "prv", "gdp"} and all(0 < e < 3 for e in data["epsilon"].values())
    assert data["delta"] == 1 / (2 * data["sample_size"]) and data["sample_size"] == 1437
    assert [h["step"] for h in data["history"]] == [2, 3]
    assert data["throughput_examples_per_s"] > 0 and data["peak_memory_bytes"] > 0
    assert data["config"]["privacy"]["epsilon"] == 3.0
    assert "accuracy=" in result.stdout and "epsilon (rdp=" in result.stdout
    assert "gdp≈" in result.stdout and "(CLT approximation)" in result.stdout


def test_gdp_calibration_fails_before_training(tmp_path):
    result = _train("steps=3", "accountant=gdp", "progress=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert (
        "ValueError: accountant=gdp calibrates sigma with the GDP central-limit approximation, which can "
        "underestimate epsilon: use accountant=rdp or accountant=prv (GDP is reported for every run anyway), "
        "or opt in with accountant.approximate_calibration=true. (for the traceback: debug=true or "
        "DPEXP_DEBUG=1)\n"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads((tmp_path / "metrics.json").read_text())["history"] == []


def test_multirun_sweeps_four_jobs(tmp_path):
    result = _train(
        "-m", "clip=nonprivate,opacus", "seed=0,1", "steps=2", "progress=false", "eval_every=null",
        f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    runs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/metrics.json"))]
    assert sorted((r["clip"], r["seed"]) for r in runs) == [
        ("nonprivate", 0),
        ("nonprivate", 1),
        ("opacus", 0),
        ("opacus", 1),
    ]
    assert all(r["status"] == "completed" for r in runs)


def test_same_config_twice_gives_identical_metrics(compose_config, tmp_path):
    cfg = compose_config([*TINY_RUN, "eval_every=1"])
    first = run_training(cfg, tmp_path / "a")
    second = run_training(cfg, tmp_path / "b")

    assert stable_record(first) == stable_record(second)
    other = run_training(compose_config([*TINY_RUN, "eval_every=1", "seed=1"]), tmp_path / "c")
    assert stable_record(other)["history"] != stable_record(first)["history"]
