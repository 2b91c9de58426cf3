"""Real signals to real ``python -m dpexp.train`` processes on the digits default: SIGTERM and SIGINT stop the
run at a step boundary with a checkpoint and an honest record; after SIGKILL at a random step, resume ends
with parameters and metrics identical, bit for bit, to an uninterrupted run's, and the same epsilon."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from dpexp.privacy import accounting
from dpexp.training.checkpoint import checkpoints, load_checkpoint
from dpexp.training.record import LOCK_FILE
from dpexp.training.signals import DUPLICATE_WINDOW, InterruptGuard, RunInterrupted
from tests.conftest import REPO_ROOT, TINY_RUN
from tests.test_checkpoint import identical, stable

ARGS = ("eval_every=5", "checkpoint.every=4", "progress=false", "batch_size=32", "physical_batch_size=16")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _start(run_dir: Path, *args: str, own_group: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dpexp.train", *ARGS, *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def _wait_until(condition: Callable[[], bool], process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run made no progress in time"
        time.sleep(0.02)


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_sigterm_and_sigint_stop_the_run_at_a_step_with_a_checkpoint(tmp_path):
    """Each signal goes to the run's whole process group, as Ctrl-C or a scheduler's preemption sends it: the
    accountant's child process gets it too, and the record still holds every accountant's epsilon."""
    runs = {signum: tmp_path / signum.name for signum in (signal.SIGTERM, signal.SIGINT)}
    processes = {signum: _start(run_dir, "steps=500", own_group=True) for signum, run_dir in runs.items()}
    for signum, process in processes.items():
        _wait_until(lambda run_dir=runs[signum]: bool(checkpoints(run_dir)), process)
        os.killpg(process.pid, signum)
    for signum, process in processes.items():
        _, err = process.communicate(timeout=120)
        assert process.returncode == 128 + signum, err
        data = _record(runs[signum])
        done = data["steps_done"]
        assert data["status"] == "interrupted" and data["error"].startswith(f"RunInterrupted: {signum.name}")
        assert 4 <= done < 500 and data["steps_accounted"] == done
        assert data["checkpoint"] == f"checkpoints/step_{done:08d}.pt"
        state = load_checkpoint(runs[signum] / data["checkpoint"])
        assert state["step"] == done and state["backend"]["steps"] == done
        sigma, q, delta = data["noise_multiplier"], data["sample_rate"], data["delta"]
        for name in accounting.ACCOUNTANTS:
            assert data["epsilon"][name] == accounting.get_epsilon(sigma, q, done, delta, accountant=name)
        assert isinstance(data["train_loss"], float) and all(h["step"] <= done for h in data["history"])
        assert f"resume={runs[signum]}" in err and "Traceback" not in err


def _running(run_dir: Path) -> psutil.Process:
    """The process running the run in ``run_dir``: the one that holds its lock file and is not a child of
    another holder (the accountant's forked child inherits the descriptor)."""
    lock = str((run_dir / LOCK_FILE).resolve())
    holders = []
    for process in psutil.process_iter():
        try:
            if any(f.path == lock for f in process.open_files()):
                holders.append(process)
        except psutil.Error:
            continue
    pids = {process.pid for process in holders}
    (runner,) = [process for process in holders if process.ppid() not in pids]
    return runner


def test_a_signal_to_one_run_of_a_local_sweep_stops_that_run_alone(tmp_path):
    """hydra/launcher=local (joblib's pool of two processes), SIGTERM to the process of one run only (`kill
    <pid>`, a scheduler ending one task): that run stops at a step boundary with a checkpoint, its worker
    starts no further run, and the other run goes on to its end. Before, the workers received the launching
    process' state with the task function (cloudpickle copies its globals), took themselves for the launching
    process and ended with SystemExit; joblib then killed the other run mid-step, its record left saying
    running, and the exception could not even be unpickled."""
    sweep = tmp_path / "sweep"
    process = subprocess.Popen(
        [sys.executable, "-m", "dpexp.train", "-m", "hydra/launcher=local", *ARGS, "eval_every=null",
         "steps=400", "seed=0,1,2", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${seed}"],
        cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_until(lambda: all(checkpoints(sweep / seed) for seed in "01"), process)
        _running(sweep / "0").send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=300)
    finally:  # whatever is left of the sweep's process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err
    stopped, finished = _record(sweep / "0"), _record(sweep / "1")
    assert stopped["status"] == "interrupted", err
    assert stopped["error"] == "RunInterrupted: SIGTERM received; stopped at a step boundary"
    assert 4 <= stopped["steps_done"] < 400 and (sweep / "0" / stopped["checkpoint"]).is_file()
    assert finished["status"] == "completed" and finished["steps_done"] == 400, err
    assert not (sweep / "2" / "metrics.json").exists()  # the signalled worker took it and did not start it
    assert f"not started, the sweep was interrupted: {sweep / '2'}" in err
    assert "Traceback" not in err


def test_sigkill_at_a_random_step_then_resume_ends_as_an_uninterrupted_run(tmp_path):
    rng = random.Random()
    first_kept, delay = rng.choice([4, 8, 12]), rng.uniform(0.0, 0.3)  # then a few more steps before the kill
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    reference = _start(whole, "steps=60")
    killed = _start(parts, "steps=60")
    _wait_until(lambda: any(int(p.stem[5:]) >= first_kept for p in checkpoints(parts)), killed)
    time.sleep(delay)
    killed.kill()
    killed.communicate(timeout=30)  # no process of the run lingers (its accountant child ends with it)
    assert killed.returncode == -signal.SIGKILL
    assert _record(parts)["status"] == "running", (first_kept, delay)  # killed before it could say more

    resumed = subprocess.run(
        [sys.executable, "-m", "dpexp.train", f"resume={parts}"],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err
    assert resumed.returncode == 0, resumed.stderr
    data, expected = _record(parts), _record(whole)
    assert data["resumes"][0]["accounted_again"] == 0 and data["steps_accounted"] == 60
    assert stable(data) == stable(expected), (first_kept, delay)
    assert data["epsilon"] == expected["epsilon"]
    final = [load_checkpoint(run / "checkpoints" / "step_00000060.pt") for run in (whole, parts)]
    for part in ("model", "optimizer", "backend", "sampler", "rng"):
        assert identical(final[0][part], final[1][part]), (part, first_kept, delay)


def test_a_signal_as_the_record_is_created_is_recorded(compose_config, tmp_path, monkeypatch):
    """SIGTERM just after the record is written and before the run object exists (a sweep's workers all get
    the signal, whatever each is doing): the record says interrupted at step 0, not running for ever."""
    from dpexp.training import loop
    from dpexp.training.signals import RunInterrupted

    create = loop.RunRecord.create

    def create_then_signal(*args, **kwargs):
        record = create(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return record

    monkeypatch.setattr(loop.RunRecord, "create", create_then_signal)
    try:
        loop.run_training(compose_config([*TINY_RUN]), tmp_path / "run")
    except RunInterrupted as interrupt:
        assert interrupt.signum == signal.SIGTERM and not interrupt.mid_step
    else:
        raise AssertionError("the run went on after SIGTERM")
    record = _record(tmp_path / "run")
    assert record["status"] == "interrupted" and record["steps_done"] == 0
    assert record["error"] == "RunInterrupted: SIGTERM received; stopped at a step boundary"


def test_the_same_signal_twice_at_once_is_one_request():
    """Ctrl-C reaches a whole process group, and a launcher may pass it on to its workers as well: the same
    signal again within DUPLICATE_WINDOW still stops the run at the step boundary; a later one stops it at
    once."""
    guard = InterruptGuard()
    with pytest.raises(RunInterrupted) as info, guard.step():
        guard._handle(signal.SIGINT, None)
        guard._handle(signal.SIGINT, None)  # the duplicate: held as one
    assert not info.value.mid_step
    guard = InterruptGuard()
    with pytest.raises(RunInterrupted) as info, guard.step():
        guard._handle(signal.SIGINT, None)
        time.sleep(DUPLICATE_WINDOW)
        guard._handle(signal.SIGINT, None)  # a second request: at once
    assert info.value.mid_step


def test_an_interrupt_pickles_as_its_signal():
    """A launcher's worker may hand the exception to the launching process: it comes back as it was."""
    for interrupt in (RunInterrupted(signal.SIGTERM), RunInterrupted(signal.SIGINT, mid_step=True)):
        back = pickle.loads(pickle.dumps(interrupt))
        assert (back.signum, back.mid_step) == (interrupt.signum, interrupt.mid_step)
        assert str(back) == str(interrupt)


class _BusyStream:
    """stderr as a signal handler finds it while the main code is inside a write to it: a second write
    raises Python's ``RuntimeError: reentrant call``; its file descriptor is ``fd`` (None: it has none)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def fileno(self) -> int:
        if self.fd is None:
            raise OSError("no file descriptor")
        return self.fd

    def write(self, text: str) -> int:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")


def test_a_signal_during_a_write_to_stderr_is_announced_without_a_traceback(capfd, monkeypatch):
    """The handler's line goes to stderr's file descriptor, not through the stream the main code may be
    writing to (through logging, that write raised and logging printed its traceback into the run's stderr:
    a flaky ``test_sigterm_and_sigint_stop_the_run_at_a_step_with_a_checkpoint``, stop 66); where stderr has
    no descriptor and is busy, the line is dropped and the signal still takes effect."""
    monkeypatch.setattr(sys, "stderr", _BusyStream(2))
    guard = InterruptGuard()
    with pytest.raises(RunInterrupted) as info, guard.step():
        guard._handle(signal.SIGTERM, None)
    assert not info.value.mid_step
    assert "SIGTERM received: stopping after this step" in capfd.readouterr().err
    monkeypatch.setattr(sys, "stderr", _BusyStream(None))
    with pytest.raises(RunInterrupted) as info:
        InterruptGuard()._handle(signal.SIGINT, None)
    assert info.value.signum == signal.SIGINT
