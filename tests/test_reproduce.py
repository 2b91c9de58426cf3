"""python -m dpexp.reproduce: the grid of an experiment, run through Hydra, skipped when already complete,
and its table rendered from the store."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dpexp import reproduce
from dpexp.config import ConfigError
from dpexp.results import experiments, store
from tests.conftest import REPO_ROOT
from tests.test_signals import ENV, _wait_until

TINY_EXPERIMENT = """
title: "Tiny: flat vs non-private on digits"
paper: "A test"
metric: accuracy
percent: true
curves: true
published: {file: cifar10, path: "setups.he2023.table11.{row}.{column}"}
rows:
  - {label: "Flat clipping, fixed", key: flat_fixed, match: {clip: bk}}
  - {label: "Non-private", key: non_private, match: {clip: nonprivate}, ignore: [privacy.epsilon]}
columns:
  - {label: "ε = 3", key: eps3, match: {privacy.epsilon: 3}}
scales:
  offline:
    note: "three steps of the digits default"
    overrides: [task=digits, model=small_cnn, steps=3, batch_size=32, physical_batch_size=16,
                eval_every=null, progress=false]
    sweeps:
      - params: {clip: bk, privacy.epsilon: 3}
      - params: {clip: nonprivate}
"""


@pytest.fixture
def tiny_experiment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(TINY_EXPERIMENT)
    monkeypatch.setattr(experiments, "EXPERIMENT_DIR", folder)
    return tmp_path


def test_reproduce_runs_the_grid_once_then_skips_it(tiny_experiment: Path, capsys) -> None:
    runs, out = tiny_experiment / "runs", tiny_experiment / "results"
    arguments = ["experiment=tiny", "scale=offline", f"runs={runs}", f"out={out}", "launcher=basic"]
    assert reproduce.main(arguments) == 0
    first = capsys.readouterr().out
    assert "2 runs: 0 complete (skipped), 0 to resume, 2 to launch" in first
    entries = store.read_index(out / store.INDEX_FILE)
    assert sorted(e["clip"] for e in entries) == ["bk", "nonprivate"]
    assert {e["status"] for e in entries} == {"completed"}
    table = (out / "tables" / "tiny_offline.md").read_text()
    assert "| Flat clipping, fixed |" in table and "63.1 ± 0.2" in table and "(n=1)" in table
    assert "Scale: offline." in table
    assert (out / "tables" / "tiny_offline.tex").read_text().startswith("\\begin{table}")
    assert (out / "figures" / "tiny_offline_curves.png").read_bytes()[:4] == b"\x89PNG"  # from the records

    assert reproduce.main(arguments) == 0
    assert "2 runs: 2 complete (skipped), 0 to resume, 0 to launch" in capsys.readouterr().out
    assert len(store.read_index(out / store.INDEX_FILE)) == 2


@pytest.mark.slow
def test_reproduce_resumes_an_unfinished_run_in_its_own_directory(tiny_experiment: Path, capsys) -> None:
    runs, out = tiny_experiment / "runs", tiny_experiment / "results"
    arguments = ["experiment=tiny", "scale=offline", f"runs={runs}", f"out={out}"]
    assert reproduce.main(arguments) == 0
    record_path = next(runs.rglob("clip-bk*/metrics.json"))
    record = json.loads(record_path.read_text())
    record.update(status="interrupted", error="RunInterrupted: SIGTERM")  # as a preempted run leaves it
    record_path.write_text(json.dumps(record))
    (record_path.parent / "train.log").write_text("[the interrupted part's log]\n")
    capsys.readouterr()
    assert reproduce.main(arguments) == 0
    assert "2 runs: 1 complete (skipped), 1 to resume, 0 to launch" in capsys.readouterr().out
    assert json.loads(record_path.read_text())["status"] == "completed"
    assert len(list(runs.rglob("metrics.json"))) == 2  # continued in place, no new run directory
    log = (record_path.parent / "train.log").read_text()  # the resumed part appended to the run's own log
    assert log.startswith("[the interrupted part's log]\n")
    assert f"resuming {record_path.parent.resolve()} at step" in log
    assert not list(runs.rglob(".resume/*/train.log"))
    assert "resume=" not in (record_path.parent / ".hydra" / "overrides.yaml").read_text()  # the run's own


REPRODUCE_IN = """
import sys
from pathlib import Path

from dpexp import reproduce
from dpexp.results import experiments

experiments.EXPERIMENT_DIR = Path(sys.argv[1])
sys.exit(reproduce.main(sys.argv[2:]))
"""


def test_a_signal_to_reproduce_reaches_each_run_once_and_starts_no_further_run(tmp_path: Path) -> None:
    """Real signals to a real ``python -m dpexp.reproduce``: SIGTERM to it alone (``kill <pid>``), and SIGINT
    to its whole process group (Ctrl-C). Either way the run in progress gets the signal once, stops at a step
    boundary with a checkpoint and an interrupted record, the grid's second run never starts, and reproduce
    exits with 128 + the signal's number. Before, SIGTERM ended reproduce alone and the orphaned run went on
    to its end; Ctrl-C reached the run and reproduce, which killed the run 0.25 s later."""
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    long = TINY_EXPERIMENT.replace("steps=3,", "steps=2000, checkpoint.every=4,")  # ~30 steps a second
    (experiment / "tiny.yaml").write_text(long)
    (tmp_path / "reproduce_in.py").write_text(REPRODUCE_IN)
    started = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        runs = tmp_path / signum.name
        arguments = ["experiment=tiny", "scale=offline", f"runs={runs}", f"out={tmp_path / 'out'}"]
        command = [sys.executable, str(tmp_path / "reproduce_in.py"), str(experiment), *arguments]
        started[signum] = subprocess.Popen(
            command, cwd=REPO_ROOT, env=ENV, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    try:
        for signum, process in started.items():
            runs = tmp_path / signum.name
            _wait_until(lambda runs=runs: bool(list(runs.glob("tiny/offline/*/checkpoints/*.pt"))), process)
            if signum == signal.SIGTERM:
                os.kill(process.pid, signum)
            else:
                os.killpg(process.pid, signum)
        for signum, process in started.items():
            _, err = process.communicate(timeout=120)
            assert process.returncode == 128 + signum, err
            assert f"{signum.name} received: the runs in progress were stopped" in err
            records = list((tmp_path / signum.name).glob("tiny/offline/*/metrics.json"))
            assert len(records) == 1, "the grid's second run was started"
            record = json.loads(records[0].read_text())
            assert record["clip"] == "bk" and record["status"] == "interrupted"
            assert record["error"] == f"RunInterrupted: {signum.name} received; stopped at a step boundary"
            assert 4 <= record["steps_done"] < 2000
            assert (records[0].parent / record["checkpoint"]).is_file()
    finally:  # whatever is left in each reproduce's group (its own, or before the fix its orphaned run)
        for process in started.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def test_a_signal_with_launcher_local_stops_every_parallel_run_at_a_step_boundary(tmp_path: Path) -> None:
    """launcher=local (joblib's process pool, two processes) and Ctrl-C: each of the two runs in progress
    stops at a step boundary with a checkpoint and an interrupted record, the grid's third run never starts,
    and reproduce exits with 130. Before, the first run to stop ended its job with SystemExit, joblib aborted
    the pool and killed the other run before it could checkpoint (its record left as running)."""
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    long = TINY_EXPERIMENT.replace("steps=3,", "steps=2000, checkpoint.every=4,").replace(
        "params: {clip: bk, privacy.epsilon: 3}", "params: {clip: bk, privacy.epsilon: 3, seed: '0,1'}"
    )
    (experiment / "tiny.yaml").write_text(long)
    (tmp_path / "reproduce_in.py").write_text(REPRODUCE_IN)
    runs = tmp_path / "runs"
    arguments = [
        "experiment=tiny",
        "scale=offline",
        "launcher=local",
        f"runs={runs}",
        f"out={tmp_path / 'out'}",
    ]
    process = subprocess.Popen(
        [sys.executable, str(tmp_path / "reproduce_in.py"), str(experiment), *arguments],
        cwd=REPO_ROOT, env=ENV, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_until(lambda: len(list(runs.glob("tiny/offline/*/checkpoints/*.pt"))) >= 4, process)
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=120)
        assert process.returncode == 128 + signal.SIGINT, err
        records = [json.loads(path.read_text()) for path in runs.glob("tiny/offline/*/metrics.json")]
        assert sorted(record["clip"] for record in records) == ["bk", "bk"], "the third run was started"
        for record, path in zip(records, runs.glob("tiny/offline/*/metrics.json"), strict=True):
            assert record["status"] == "interrupted", err
            assert record["error"] == "RunInterrupted: SIGINT received; stopped at a step boundary"
            assert 4 <= record["steps_done"] < 2000
            assert (path.parent / record["checkpoint"]).is_file()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_a_local_pool_is_never_larger_than_the_multirun() -> None:
    """launcher=local: n_jobs (2 in conf/hydra/launcher/local.yaml, or as given) is cut to the number of
    jobs, so that no pool process waits without a job (one would die of the sweep's Ctrl-C, and joblib would
    then kill the runs); other launchers are left alone."""
    launch = ["hydra/launcher=local", "logger=none"]
    assert reproduce.pool_size(launch, "local", 1) == ["hydra.launcher.n_jobs=1", *launch]
    assert reproduce.pool_size(launch, "local", 2) == launch
    given = [*launch, "hydra.launcher.n_jobs=4"]
    assert reproduce.pool_size(given, "local", 3) == ["hydra.launcher.n_jobs=3", *launch]
    assert reproduce.pool_size(given, "local", 5) == given
    assert reproduce.pool_size(["hydra/launcher=slurm"], "slurm", 1) == ["hydra/launcher=slurm"]
    assert reproduce.pool_size([], "basic", 1) == []


def test_logger_wandb_groups_every_run_of_the_experiment(tiny_experiment: Path, monkeypatch) -> None:
    """logger=wandb reaches every launched and resumed run with the experiment's group; the group is run-local
    (it changes no config hash)."""
    calls = []
    monkeypatch.setattr(reproduce, "_multirun", lambda overrides: calls.append(list(overrides)) or 0)
    spec = experiments.load_experiment("tiny")
    points = experiments.grid_points("tiny", spec, "offline")
    configs = dict(zip(points, experiments.compose_points(points), strict=True))
    keys = {p: store.config_key(experiments.resolved(c)) for p, c in configs.items()}
    plan = reproduce.RunPlan(launch=points[:1], resume=[(points[1], str(tiny_experiment / "old"))])
    logging = ["logger=wandb", "wandb.group=tiny-offline"]
    reproduce.execute(plan, configs, keys, tiny_experiment / "sweep", "abc123", "local", [], logging)
    assert len(calls) == 2 and all(call[-2:] == logging for call in calls)
    assert "hydra/launcher=local" in calls[0] and calls[1][0].startswith("resume=")
    grouped = OmegaConf.merge(configs[points[0]], {"logger": "wandb", "wandb": {"group": "tiny-offline"}})
    assert store.config_key(experiments.resolved(grouped)) == keys[points[0]]
    with pytest.raises(ConfigError, match="logger=mlflow is not a logger; valid: none, wandb"):
        reproduce.parse_arguments(["experiment=tiny", "scale=offline", "logger=mlflow"])


def test_rows_and_columns_select_the_runs_of_those_cells(tiny_experiment: Path, capsys) -> None:
    """rows=/columns= launch only the named cells' points; the table is still rendered whole."""
    spec = experiments.load_experiment("tiny")
    points = experiments.grid_points("tiny", spec, "offline")
    chosen = reproduce.selected_points(spec, points, "non_private", None)
    assert [p.settings["clip"] for p in chosen] == ["nonprivate"]
    assert reproduce.selected_points(spec, points, None, "eps3") == points  # the non-private row ignores eps
    assert reproduce.selected_points(spec, points, "flat_fixed,non_private", "eps3") == points
    with pytest.raises(ConfigError, match="rows=adaptive: not a key of the table"):
        reproduce.selected_points(spec, points, "adaptive", None)
    with pytest.raises(ConfigError, match="columns=: not a key"):
        reproduce.selected_points(spec, points, None, "")

    runs, out = tiny_experiment / "runs", tiny_experiment / "results"
    arguments = ["experiment=tiny", "scale=offline", f"runs={runs}", f"out={out}", "rows=non_private"]
    assert reproduce.main(arguments) == 0
    assert "1 selected runs: 0 complete (skipped), 0 to resume, 1 to launch" in capsys.readouterr().out
    assert [e["clip"] for e in store.read_index(out / store.INDEX_FILE)] == ["nonprivate"]
    table = (out / "tables" / "tiny_offline.md").read_text()
    assert "| Flat clipping, fixed | not run |" in table


def test_where_keeps_the_points_with_those_settings(tiny_experiment: Path, monkeypatch, capsys) -> None:
    """where= narrows the grid to points by their settings: numbers compared as numbers, a key named twice
    takes either value, all keys must hold; an unknown key, a malformed pair or an empty result is refused."""
    spec = experiments.load_experiment("tiny")
    points = experiments.grid_points("tiny", spec, "offline")
    clips = [p.settings["clip"] for p in reproduce.filtered_points(points, "clip=nonprivate")]
    assert clips == ["nonprivate"]
    assert [p.settings["clip"] for p in reproduce.filtered_points(points, "privacy.epsilon=3.0")] == ["bk"]
    assert reproduce.filtered_points(points, "clip=bk,clip=nonprivate,steps=3") == points
    assert reproduce.filtered_points(points, None) == points
    with pytest.raises(ConfigError, match=r"no run of the grid sets optim\.lr; keys: .*clip"):
        reproduce.filtered_points(points, "optim.lr=1e-3")
    with pytest.raises(ConfigError, match="'seed' is not key=value"):
        reproduce.filtered_points(points, "clip=bk,seed")
    with pytest.raises(ConfigError, match="selects no run of the grid"):
        reproduce.filtered_points(points, "clip=bk,steps=4")

    monkeypatch.setattr(reproduce, "_multirun", lambda overrides: pytest.fail(f"launched {overrides}"))
    runs, out = tiny_experiment / "runs", tiny_experiment / "results"
    arguments = ["experiment=tiny", "scale=offline", f"runs={runs}", f"out={out}", "dry_run=true"]
    assert reproduce.main([*arguments, "where=clip=bk"]) == 0
    printed = capsys.readouterr().out
    assert "1 selected runs: 0 complete (skipped), 0 to resume, 1 to launch" in printed
    assert "clip=bk" in printed and "clip=nonprivate" not in printed


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_experiment: Path, monkeypatch, capsys) -> None:
    """dry_run=true reads the store and prints what it would launch; it launches, indexes, renders nothing."""
    monkeypatch.setattr(reproduce, "_multirun", lambda overrides: pytest.fail(f"launched {overrides}"))
    runs, out = tiny_experiment / "runs", tiny_experiment / "results"
    runs.mkdir()
    arguments = ["experiment=tiny", "scale=offline", f"runs={runs}", f"out={out}", "dry_run=true"]
    assert reproduce.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "2 runs: 0 complete (skipped), 0 to resume, 2 to launch" in printed
    launches = [line for line in printed.splitlines() if line.startswith("  launch: ")]
    assert len(launches) == 2 and any("clip=bk" in line for line in launches)
    assert not out.exists() and not any(runs.iterdir())


def test_render_removes_the_figures_its_records_no_longer_give(tiny_experiment: Path) -> None:
    """A figure left by an earlier render (its runs since rerun by newer code, or removed) is deleted, not
    kept beside tables that no longer say what it shows: the folder holds what the store draws."""
    out = tiny_experiment / "results"
    names = [f"tiny_offline_{suffix}.png" for suffix in ("epsilon", "thresholds", "curves", "time")]
    for name in names:
        (out / "figures").mkdir(parents=True, exist_ok=True)
        (out / "figures" / name).write_bytes(b"an earlier render")
    source = {"source_hash": "new", "commit": None, "dirty": None}
    written = reproduce.render("tiny", "offline", [], out, source)
    assert sorted(path.name for path in written) == ["tiny_offline.md", "tiny_offline.tex"]
    assert not [name for name in names if (out / "figures" / name).exists()]
