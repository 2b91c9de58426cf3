"""Checkpoints and resume: what a checkpoint holds and how it is written, and a resumed run that ends exactly
where an uninterrupted one ends, every step accounted once (the subprocess version, with real SIGKILL, is in
test_signals.py)."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from dpexp.config import ConfigError
from dpexp.privacy import PrivacyEngine, accounting
from dpexp.training import checkpoint as checkpoint_module
from dpexp.training.checkpoint import Checkpointer, CheckpointPolicy, checkpoints, load_checkpoint
from dpexp.training.hooks import RunHooks
from dpexp.training.loop import run_training
from dpexp.training.record import RunDirectoryError, RunRecord
from dpexp.training.resume import load_run_config, resumed_config
from dpexp.training.signals import RunInterrupted
from tests.conftest import stable_record as stable

RUN = ("steps=15", "eval_every=4", "checkpoint.every=5", "progress=false", "batch_size=32")


class SignalAt(RunHooks):
    """Sends this process ``signum`` in the middle of step ``step`` (before its update)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def before_step(self, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), self.signum)


class FailAt(RunHooks):
    """Raises in the middle of step ``step`` (a run that fails after it has recorded steps)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, step: int) -> None:
        if step == self.step:
            raise RuntimeError("injected failure")


def identical(a: object, b: object) -> bool:
    """Equal, tensors bit for bit, at any depth."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(identical, a, b))
    return a == b


def _read(path) -> dict:
    return json.loads((path / "metrics.json").read_text())


def _resume(run_dir) -> dict:
    return run_training(load_run_config(run_dir), run_dir, resume=True)


def test_interrupted_and_resumed_run_ends_as_an_uninterrupted_one(compose_config, tmp_path):
    cfg = compose_config(list(RUN))
    whole = run_training(cfg, tmp_path / "whole")
    parts = tmp_path / "parts"
    with pytest.raises(RunInterrupted, match="SIGTERM"):
        run_training(cfg, parts, hooks=SignalAt(7))
    stopped = _read(parts)
    assert stopped["status"] == "interrupted" and stopped["steps_done"] == 7
    assert stopped["checkpoint"] == "checkpoints/step_00000007.pt"
    assert stopped["epsilon"]["rdp"] == pytest.approx(
        accounting.get_epsilon(stopped["noise_multiplier"], stopped["sample_rate"], 7, stopped["delta"])
    )

    resumed = _resume(parts)
    assert resumed["resumes"] == [{"from_step": 7, "recorded_steps": 7, "accounted_again": 0}]
    assert stable(resumed) == stable(whole)
    assert [h["step"] for h in resumed["history"]] == [4, 8, 12, 15]
    final = [load_checkpoint(run / "checkpoints" / "step_00000015.pt") for run in (tmp_path / "whole", parts)]
    for part in ("model", "optimizer", "backend", "sampler", "rng"):
        assert identical(final[0][part], final[1][part]), part


@pytest.mark.parametrize("secure", [False, True])
def test_resume_accounts_every_step_once(compose_config, tmp_path, secure):
    """A run fails at step 4 after recording step 3; its checkpoint is from step 2. Resumed, it redoes step
    3: with the same noise that releases nothing new; with fresh (secure-mode) noise it is accounted again."""
    cfg = compose_config(
        [*RUN, "steps=6", "eval_every=1", "checkpoint.every=2", f"clip.engine.secure_mode={secure}"]
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        run_training(cfg, tmp_path, hooks=FailAt(4))
    failed = _read(tmp_path)
    assert failed["status"] == "failed" and failed["steps_done"] == 3
    assert [h["step"] for h in failed["history"]] == [1, 2, 3]

    resumed = _resume(tmp_path)
    again = int(secure)
    assert resumed["resumes"] == [{"from_step": 2, "recorded_steps": 3, "accounted_again": again}]
    assert resumed["steps_done"] == 6 and resumed["steps_accounted"] == 6 + again
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4, 5, 6]
    spent = accounting.get_epsilon(
        resumed["noise_multiplier"], resumed["sample_rate"], 6 + again, resumed["delta"]
    )
    assert resumed["epsilon"]["rdp"] == pytest.approx(spent) and resumed["history"][-1]["epsilon"] == spent


def test_resume_without_a_checkpoint_starts_over_in_the_same_record(compose_config, tmp_path):
    cfg = compose_config([*RUN, "steps=3", "eval_every=1", "checkpoint.every=null"])
    with pytest.raises(RuntimeError):
        run_training(cfg, tmp_path, hooks=FailAt(3))
    assert checkpoints(tmp_path) == []
    resumed = _resume(tmp_path)
    assert resumed["status"] == "completed" and [h["step"] for h in resumed["history"]] == [1, 2, 3]
    assert resumed["resumes"] == [{"from_step": 0, "recorded_steps": 2, "accounted_again": 0}]


def test_a_lost_checkpoint_is_named_and_the_run_redone_from_the_last_one_left(
    compose_config, tmp_path, caplog
):
    """The record names the checkpoint of step 7, which is gone (e.g. a fresh clone: checkpoints are not
    committed). The resume says so and starts over; the redone steps draw the same batches and noise, so the
    run ends as an uninterrupted one and no step is accounted twice."""
    cfg = compose_config(list(RUN))
    whole = run_training(cfg, tmp_path / "whole")
    parts = tmp_path / "parts"
    with pytest.raises(RunInterrupted):
        run_training(cfg, parts, hooks=SignalAt(7))
    for path in checkpoints(parts):
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="dpexp.training.loop"):
        resumed = _resume(parts)
    assert "checkpoints/step_00000007.pt is missing; continuing from the start" in caplog.text
    assert resumed["resumes"] == [{"from_step": 0, "recorded_steps": 7, "accounted_again": 0}]
    assert stable(resumed) == stable(whole)


def test_resume_refusals(compose_config, tmp_path):
    with pytest.raises(RunDirectoryError, match=r"no metrics\.json"):
        load_run_config(tmp_path / "nothing")
    run_training(compose_config([*RUN, "steps=2", "eval_every=null"]), tmp_path)
    with pytest.raises(RunDirectoryError, match="that run is completed"):
        _resume(tmp_path)
    composed = compose_config(["checkpoint.every=3", "optim.lr=0.5"])
    with pytest.raises(ConfigError, match=r"optim.lr would change.*checkpoint"):
        resumed_config(tmp_path, composed, [f"resume={tmp_path}", "optim.lr=0.5"])
    cfg = resumed_config(tmp_path, composed, [f"resume={tmp_path}", "checkpoint.every=3", "device=cpu"])
    assert cfg.checkpoint.every == 3 and cfg.optim.lr == _read(tmp_path)["config"]["optim"]["lr"]
    assert cfg.steps == 2 and cfg.resume is None


def test_one_process_at_a_time_runs_a_run(compose_config, tmp_path):
    with pytest.raises(RuntimeError):
        run_training(compose_config([*RUN, "steps=3"]), tmp_path, hooks=FailAt(2))
    holder = RunRecord.reopen(tmp_path)  # as a process that is still running it would
    with pytest.raises(RunDirectoryError, match="another process is running this run now"):
        _resume(tmp_path)
    holder.close()
    assert _resume(tmp_path)["status"] == "completed"


def test_a_checkpoint_loads_with_weights_only_and_holds_the_state(compose_config, tmp_path):
    run_training(compose_config([*RUN, "steps=4", "checkpoint.every=2", "checkpoint.keep=1"]), tmp_path)
    (path,) = checkpoints(tmp_path)
    state = torch.load(path, weights_only=True)  # no code runs when a checkpoint is read
    assert state["step"] == 4 and state["format"] == checkpoint_module.FORMAT
    expected = {
        "plan",
        "model",
        "optimizer",
        "scheduler",
        "sampler",
        "backend",
        "rng",
        "progress",
        "evaluations",
    }
    assert expected <= set(state)
    assert state["backend"]["steps"] == 4 and state["backend"]["thresholds"].dtype == torch.float64
    assert state["progress"]["steps_accounted"] == 4 and state["sampler"]["done"] == 4
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_checkpointer_keeps_the_last_k_and_writes_by_steps_or_time(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: clock[0])
    writer = Checkpointer(tmp_path, CheckpointPolicy(every=3, every_minutes=2, keep=2))
    assert [step for step in range(1, 8) if writer.due(step)] == [3, 6]
    clock[0] += 121
    assert writer.due(4)
    for step in (3, 4, 6):
        writer.save(step, {"value": torch.tensor(step)})
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000004.pt", "step_00000006.pt"]
    assert not writer.due(7)  # the clock restarts at every save
    assert load_checkpoint(checkpoints(tmp_path)[-1])["value"] == 6


def test_checkpoints_at_epochs_are_written_and_never_dropped(tmp_path):
    policy = CheckpointPolicy.from_config(
        OmegaConf.create({"every": 3, "every_minutes": None, "keep": 1, "at_epochs": [0, 0.5, 1]})
    )
    kept = policy.steps_at_epochs(sample_rate=0.25, steps=6)  # 4 steps an epoch
    assert kept == {0.0: 0, 0.5: 2, 1.0: 4}
    writer = Checkpointer(tmp_path, policy, frozenset(kept.values()))
    assert [step for step in range(1, 7) if writer.due(step)] == [2, 3, 4, 6]
    for step in (0, 2, 3, 4, 5, 6):  # 5: as an interrupt writes one
        writer.save(step, {"value": torch.tensor(step)})
    # 0, 2 and 4 are kept whatever keep says; of the others only the last one (keep=1)
    assert [p.name for p in checkpoints(tmp_path)] == [f"step_{s:08d}.pt" for s in (0, 2, 4, 6)]
    with pytest.raises(ConfigError, match=r"epochs \[2.0\] come after the run's last step \(6 steps"):
        CheckpointPolicy(at_epochs=(1.0, 2.0)).steps_at_epochs(sample_rate=0.25, steps=6)


def test_a_run_keeps_its_checkpoints_at_epochs_from_before_the_first_step(compose_config, tmp_path):
    """checkpoint.at_epochs=[0, 1]: the untrained model (step 0) and the one after the first epoch are kept
    beside the last periodic one; an epoch the run does not reach is refused."""
    cfg = compose_config(
        [
            "epochs=2",
            "batch_size=479",
            "physical_batch_size=479",
            "progress=false",
            "eval_every=null",
            "checkpoint.every=1",
            "checkpoint.keep=1",
            "checkpoint.at_epochs=[0,1]",
        ]
    )  # digits: N = 1437, q = 1/3, 3 steps an epoch
    run_training(cfg, tmp_path)
    assert [p.name for p in checkpoints(tmp_path)] == [f"step_{s:08d}.pt" for s in (0, 3, 6)]
    first = load_checkpoint(checkpoints(tmp_path)[0])
    assert first["step"] == 0 and first["progress"]["steps_accounted"] == 0
    bad = compose_config(["steps=3", "progress=false", "checkpoint.at_epochs=[5]"])
    with pytest.raises(ConfigError, match=r"checkpoint\.at_epochs=\[5\.0\]: epochs \[5\.0\] come after"):
        run_training(bad, tmp_path / "bad")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("every", 0),
        ("every_minutes", 0),
        ("every_minutes", float("inf")),
        ("keep", 0),
        ("at_epochs", [1, -1]),
    ],
)
def test_checkpoint_policy_refuses_bad_values(key, value):
    node = OmegaConf.create({"every": None, "every_minutes": None, "keep": 2} | {key: value})
    with pytest.raises(ConfigError, match=rf"checkpoint\.{key} must be"):
        CheckpointPolicy.from_config(node)


def _engine_step(engine: PrivacyEngine, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    optimizer.step()
    optimizer.zero_grad()


def test_engine_state_dict_round_trip():
    def build(
        generator: torch.Generator | None = None,
    ) -> tuple[PrivacyEngine, torch.optim.Optimizer, nn.Module]:
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        engine = PrivacyEngine(
            model,
            batch_size=8,
            sample_size=80,
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            clipping="per_layer",
            adaptive={"target_quantile": 0.5, "quantile_lr": 0.3, "budget_fraction": 0.1},
            generator=generator,
        )
        return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=0.1)), model

    torch.manual_seed(0)
    engine, optimizer, model = build(torch.Generator().manual_seed(1))
    for _ in range(2):
        _engine_step(engine, optimizer, model)
    state = engine.state_dict()
    assert state["steps"] == 2 and not torch.equal(state["thresholds"], torch.full((4,), 0.5))

    other, _, _ = build(torch.Generator())
    other.load_state_dict(state)
    assert other.steps == 2 and torch.equal(other.thresholds, engine.thresholds)
    assert torch.equal(other.generator.get_state(), engine.generator.get_state())
    with pytest.raises(ValueError, match="generator"):
        build()[0].load_state_dict(state)
    flat = PrivacyEngine(
        nn.Linear(4, 3), batch_size=8, sample_size=80, max_grad_norm=1.0, noise_multiplier=1.0
    )
    with pytest.raises(ValueError, match="1 groups"):
        flat.load_state_dict(state)
    engine.backward(
        F.cross_entropy(model(torch.randn(8, 4)), torch.zeros(8, dtype=torch.long), reduction="none")
    )
    with pytest.raises(RuntimeError, match="between steps"):
        engine.state_dict()
