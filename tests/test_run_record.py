"""metrics.json: written incrementally, on success and on failure, always strict JSON."""

from __future__ import annotations

import fcntl
import json
import sys
import types
from datetime import datetime

import pytest
import torch

from dpexp.tasks.digits import DigitsTask
from dpexp.train import summary
from dpexp.training.hooks import RunHooks
from dpexp.training.loop import run_training
from dpexp.training.record import RunDirectoryError, RunRecord, peak_memory
from tests.conftest import TINY_RUN


class ExplodingTask(DigitsTask):
    """Digits whose loss raises on its ``fail_at_call``-th call (a failure in the middle of training)."""

    def __init__(self, fail_at_call: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_at_call = fail_at_call
        self.calls = 0

    def per_example_loss(self, model, batch):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("injected failure")
        return super().per_example_loss(model, batch)


class MissingDataTask(DigitsTask):
    def setup(self, factory) -> None:
        raise FileNotFoundError("no such data file: /nowhere/train.csv")


def _target(cls: type) -> str:
    return f"task._target_={cls.__module__}.{cls.__qualname__}"


def _read(path):
    def refuse(constant):
        raise AssertionError(f"metrics.json holds the non-JSON constant {constant}")

    return json.loads((path / "metrics.json").read_text(), parse_constant=refuse)


def test_completed_run(compose_config, tmp_path):
    record = run_training(compose_config([*TINY_RUN, "eval_every=1"]), tmp_path)
    data = _read(tmp_path)
    assert data == json.loads(json.dumps(record))
    assert data["status"] == "completed" and data["error"] is None
    assert [h["step"] for h in data["history"]] == [1, 2, 3]
    assert data["accuracy"] == data["history"][-1]["accuracy"]
    assert 0 < data["history"][0]["epsilon"] < data["history"][-1]["epsilon"] == data["epsilon"]["rdp"]
    # every accountant is reported; GDP labelled as the approximation it is, in the file and on the console
    assert data["epsilon_kind"] == {"rdp": "upper_bound", "prv": "upper_bound", "gdp": "clt_approximation"}
    text = summary(record)
    eps = data["epsilon"]
    assert f"rdp={eps['rdp']:.3f}, prv={eps['prv']:.3f}, gdp≈{eps['gdp']:.3f} (CLT approximation)" in text


def test_failure_mid_training_keeps_the_metrics_so_far(compose_config, tmp_path):
    overrides = [
        *TINY_RUN,
        "eval_every=1",
        "physical_batch_size=1000",
        _target(ExplodingTask),
        "+task.fail_at_call=2",
    ]
    with pytest.raises(RuntimeError, match="injected failure"):
        run_training(compose_config(overrides), tmp_path)
    data = _read(tmp_path)
    assert data["status"] == "failed"
    assert data["error"] == "RuntimeError: injected failure"
    assert [h["step"] for h in data["history"]] == [1]  # the evaluation before the failure
    assert data["noise_multiplier"] > 0 and data["wall_time_s"] > 0
    assert data["config"]["task"]["fail_at_call"] == 2


def test_failure_in_setup_still_writes_metrics(compose_config, tmp_path):
    with pytest.raises(FileNotFoundError):
        run_training(compose_config([*TINY_RUN, _target(MissingDataTask)]), tmp_path)
    data = _read(tmp_path)
    assert data["status"] == "failed" and "/nowhere/train.csv" in data["error"]
    assert data["history"] == [] and data["config"]["steps"] == 3


def test_gdp_calibration_is_refused_before_the_data_loads(compose_config, tmp_path):
    with pytest.raises(ValueError, match=r"accountant\.approximate_calibration=true"):
        run_training(compose_config([*TINY_RUN, _target(MissingDataTask), "accountant=gdp"]), tmp_path)
    data = _read(tmp_path)
    assert data["status"] == "failed" and data["error"].startswith("ValueError: accountant=gdp")
    assert "\n" not in data["error"]


def test_nonprivate_run_reports_no_epsilon(compose_config, tmp_path):
    run_training(compose_config([*TINY_RUN, "clip=nonprivate"]), tmp_path)
    data = _read(tmp_path)
    assert data["epsilon"] == {"rdp": None, "prv": None, "gdp": None}
    assert data["noise_multiplier"] == 0.0 and data["target_epsilon"] is None


def test_record_refuses_metric_names_that_shadow_run_fields(tmp_path):
    record = RunRecord.create(tmp_path, {"steps": 3})
    record.log_eval({"step": 1}, {"accuracy": 0.5})
    record.log_eval({"step": 2}, {"accuracy": 0.6})  # the same metric again is fine
    with pytest.raises(ValueError, match="steps"):
        record.log_eval({"step": 3}, {"steps": 1.0})
    assert _read(tmp_path)["accuracy"] == 0.6


def test_peak_memory_on_cpu():
    bytes_, kind = peak_memory(torch.device("cpu"))
    assert kind == "cpu_peak_rss" and bytes_ > 10 * 2**20


def test_wandb_logger_mirrors_evaluations_offline(compose_config, tmp_path, monkeypatch):
    """The wandb sink with a stand-in module (wandb is an optional extra): offline mode, one log per eval."""
    calls = {"log": [], "summary": {}}

    class FakeRun:
        summary = calls["summary"]

        def log(self, values, step):
            calls["log"].append((step, values))

        def finish(self, exit_code):
            calls["exit_code"] = exit_code

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    run_training(compose_config([*TINY_RUN, "eval_every=1", "logger=wandb", "wandb.group=sweep-a"]), tmp_path)
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "dpexp"
    assert calls["init"]["group"] == "sweep-a"
    assert [step for step, _ in calls["log"]] == [1, 2, 3]
    assert "accuracy" in calls["log"][-1][1] and calls["summary"]["status"] == "completed"
    assert calls["exit_code"] == 0


def test_non_finite_numbers_are_stored_as_strings(tmp_path):
    nan, inf = float("nan"), float("inf")
    record = RunRecord.create(
        tmp_path, {"loss": nan, "epsilon": {"gdp": [inf, -inf, 1.5]}, "t": torch.tensor(nan)}
    )
    record.write()
    data = _read(tmp_path)
    assert (
        data["loss"] == "NaN"
        and data["t"] == "NaN"
        and data["epsilon"] == {"gdp": ["Infinity", "-Infinity", 1.5]}
    )
    assert [float(value) for value in data["epsilon"]["gdp"]] == [inf, -inf, 1.5]


def test_a_record_is_never_overwritten_by_another_run(compose_config, tmp_path):
    run_training(compose_config(list(TINY_RUN)), tmp_path)
    first = (tmp_path / "metrics.json").read_text()
    with pytest.raises(RunDirectoryError, match="already holds another run's record"):
        run_training(compose_config([*TINY_RUN, "seed=1"]), tmp_path)
    assert (tmp_path / "metrics.json").read_text() == first


class Unstorable(RunHooks):
    def finished(self, model, task):
        return {"odd": object()}


def test_a_value_json_cannot_hold_still_leaves_a_failed_record(compose_config, tmp_path):
    with pytest.raises(TypeError, match=r"metrics\.json cannot store object"):
        run_training(compose_config(list(TINY_RUN)), tmp_path, hooks=Unstorable())
    data = _read(tmp_path)
    assert data["status"] == "failed" and data["error"].startswith("TypeError")
    assert data["odd"].startswith("<object object") and data["steps_done"] == 3


def test_a_process_keeps_the_code_version_it_started_with(monkeypatch):
    """A multirun's later jobs run the modules its process imported at the start: files changed on disk
    since must not be credited to them (the version is taken once per process)."""
    from dpexp import runtime

    first = runtime.process_code_version()
    monkeypatch.setattr(
        runtime, "code_version", lambda: {"source_hash": "f" * 16, "commit": None, "dirty": True}
    )
    assert runtime.code_version()["source_hash"] == "f" * 16  # the files on disk "changed"
    assert runtime.process_code_version() == first  # the process' code did not


def test_record_keeps_the_code_version_that_started_it_and_each_other_that_resumed_it(
    compose_config, tmp_path, monkeypatch
):
    from dpexp.runtime import code_version
    from dpexp.training import loop

    cfg = compose_config([*TINY_RUN, _target(MissingDataTask)])
    with pytest.raises(FileNotFoundError):
        run_training(cfg, tmp_path)
    started, started_at = _read(tmp_path)["code_version"], _read(tmp_path)["started_at"]
    assert started == code_version() and len(started["source_hash"]) == 16
    assert datetime.fromisoformat(started_at).tzinfo is not None  # UTC: tables order older versions by it
    with pytest.raises(FileNotFoundError):  # resumed by the same code: nothing added
        run_training(cfg, tmp_path, resume=True)
    assert "resumed_by_code" not in _read(tmp_path) and _read(tmp_path)["started_at"] == started_at
    other = {"source_hash": "0" * 16, "commit": None, "dirty": None}
    monkeypatch.setattr(loop, "process_code_version", lambda: other)
    with pytest.raises(FileNotFoundError):
        run_training(cfg, tmp_path, resume=True)
    data = _read(tmp_path)
    assert data["code_version"] == started and data["resumed_by_code"] == [other]
    assert "resumed_on" not in data  # the same machine


def test_record_keeps_the_machine_that_started_it_and_each_other_that_resumed_it(
    compose_config, tmp_path, monkeypatch
):
    """The same code gives the same numbers only on the same kind of machine: the record keeps its CPU, the
    instruction set torch's kernels were chosen for, the torch build and the GPU; a resume elsewhere adds."""
    from dpexp.runtime import machine
    from dpexp.training import loop

    cfg = compose_config([*TINY_RUN, _target(MissingDataTask)])
    with pytest.raises(FileNotFoundError):
        run_training(cfg, tmp_path)
    started = _read(tmp_path)["machine"]
    assert started == machine(torch.device("cpu")) and started["gpu"] is None
    assert started["torch"] == torch.__version__
    assert started["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    other = {**started, "cpu_capability": "elsewhere"}
    monkeypatch.setattr(loop, "machine", lambda device: other)
    for _ in range(2):  # resumed twice there: each resume is listed
        with pytest.raises(FileNotFoundError):
            run_training(cfg, tmp_path, resume=True)
    data = _read(tmp_path)
    assert data["machine"] == started and data["resumed_on"] == [other, other]


def test_a_record_that_cannot_be_written_leaves_no_file_behind(tmp_path):
    """A field JSON cannot hold fails the creation before anything exists: the directory still takes a run
    (an empty metrics.json would have claimed it for good, and resume could not read it)."""
    with pytest.raises(TypeError, match="cannot store object"):
        RunRecord.create(tmp_path, {"steps": 3, "bad": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    RunRecord.create(tmp_path, {"steps": 3}).close()  # the lock was released, the directory is free
    assert _read(tmp_path)["steps"] == 3 and _read(tmp_path)["status"] == "running"


def test_resuming_a_directory_whose_record_is_not_json_says_so(tmp_path):
    (tmp_path / "metrics.json").write_text("")
    with pytest.raises(RunDirectoryError, match=r"is not a run record.*new directory"):
        RunRecord.reopen(tmp_path)
    with open(tmp_path / ".lock") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
