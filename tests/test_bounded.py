"""Accountants under memory and time limits: a child process answers, or is stopped with a message naming the
key to raise; PRV at a huge epsilon is reported as failed instead of taking the machine down."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

import numpy as np
import pytest

from dpexp.training.bounded import BoundedCalls, LimitExceeded, Limits
from dpexp.training.budget import PrivacyBudget
from dpexp.training.loop import run_training
from dpexp.training.plan import RunPlan
from tests.conftest import TINY_RUN

LIMITS = Limits(256 * 2**20, 20.0, "privacy.accounting_memory_gib", "privacy.accounting_timeout_s")


def allocate(gib: float) -> float:
    return float(np.ones(int(gib * 2**30 / 8)).sum())


def refuse(message: str) -> None:
    raise ValueError(message)


def warn_and_return(value: int) -> int:
    warnings.warn("careful", UserWarning, stacklevel=1)
    return value


def test_a_call_returns_its_value_raises_its_error_and_re_emits_its_warnings():
    with BoundedCalls(LIMITS) as calls:
        assert calls(allocate, 0.01, what="small") == int(0.01 * 2**30 / 8)
        with pytest.raises(ValueError, match=r"^no way$"):
            calls(refuse, "no way", what="refusal")
        with pytest.warns(UserWarning, match="careful"):
            assert calls(warn_and_return, 3, what="warning") == 3


def signal_self_then_return(signum: int, value: int) -> int:
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # a signal that ends the process has done so by now
    return value


def test_the_signals_that_stop_a_run_leave_the_child_serving_and_other_deaths_are_explained():
    with BoundedCalls(LIMITS) as calls:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # they reach the whole process group
            assert calls(signal_self_then_return, signum, 7, what="accounting") == 7
        with pytest.raises(
            LimitExceeded, match=r"^accounting: its process was stopped by signal SIGUSR1 from"
        ):
            calls(signal_self_then_return, signal.SIGUSR1, 7, what="accounting")
        with pytest.raises(
            LimitExceeded,
            match=r"accounting: its process died \(signal SIGKILL\), most likely out of memory; lower the "
            r"demand or raise privacy\.accounting_memory_gib",
        ):
            calls(signal_self_then_return, signal.SIGKILL, 7, what="accounting")
        assert calls(signal_self_then_return, signal.SIGTERM, 8, what="accounting") == 8  # forked again


def test_memory_and_time_beyond_the_limits_are_refused_naming_the_key():
    with BoundedCalls(LIMITS) as calls:
        with pytest.raises(
            LimitExceeded, match=r"big needs more memory than privacy\.accounting_memory_gib=0\.25"
        ):
            calls(allocate, 2, what="big")
        assert calls(allocate, 0.01, what="small") > 0  # a fresh child serves the next call
    with BoundedCalls(Limits(2**30, 0.5, "memory", "privacy.accounting_timeout_s")) as calls:
        started = time.monotonic()
        with pytest.raises(LimitExceeded, match=r"slow ran longer than privacy\.accounting_timeout_s=0\.5 s"):
            calls(time.sleep, 30, what="slow")
        assert time.monotonic() - started < 10
        assert calls(allocate, 0.01, what="small") > 0


def test_prv_at_a_huge_epsilon_is_reported_as_failed_and_the_others_answer():
    q, steps, delta = 32 / 1437, 3, 1 / 2874
    sigmas = [0.0012845400243646937] * steps
    plan = RunPlan(1437, 32, 16, q, steps, steps * q, delta, 1e6, sigmas[0], "constant", sigmas, False)
    with PrivacyBudget(Limits(2**30, 60.0, "privacy.accounting_memory_gib", "t")) as budget:
        epsilons, errors = budget.epsilons(plan, sigmas)
    assert epsilons["prv"] is None and "privacy.accounting_memory_gib=1 GiB" in errors["prv"]
    assert epsilons["rdp"] == pytest.approx(1e6, rel=1e-3) and epsilons["gdp"] == float("inf")


def test_a_run_at_epsilon_1e6_completes_with_every_accountant_answered_or_explained(compose_config, tmp_path):
    cfg = compose_config([*TINY_RUN, "privacy.epsilon=1e6", "privacy.accounting_memory_gib=1"])
    record = run_training(cfg, tmp_path)
    assert record["status"] == "completed"
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["epsilon"]["prv"] is None and "accounting_memory_gib" in data["epsilon_errors"]["prv"]
    assert data["epsilon"]["gdp"] == "Infinity" and data["epsilon"]["rdp"] == pytest.approx(1e6, rel=1e-3)


def test_calibration_beyond_the_limits_fails_the_run_cleanly(compose_config, tmp_path):
    cfg = compose_config(
        [*TINY_RUN, "privacy.epsilon=1e6", "accountant=prv", "privacy.accounting_memory_gib=1"]
    )
    with pytest.raises(LimitExceeded, match="calibrating sigma with the prv accountant needs more memory"):
        run_training(cfg, tmp_path)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["status"] == "failed" and data["steps_done"] == 0
