"""Checkpoints of a run: ``<run dir>/checkpoints/step_<k>.pt``, written atomically (temporary file, fsync,
rename), the last ``checkpoint.keep`` of them kept, and those of ``checkpoint.at_epochs`` kept for good.

``checkpoint.at_epochs`` keeps the model as it was at chosen epochs for analyses after training (He et al.
2023, Figure 2 and app. B: per-layer gradient norms of checkpoints at several epochs; the experiment
``he2023_figure2``): epoch e is the checkpoint after step ``round(e / q)`` (q = B / N, as the plan turns
``epochs`` into steps), epoch 0 the model before the first step.

A checkpoint holds what the run needs to go on as if it had never stopped (the run assembles it:
:meth:`dpexp.training.loop._Run.checkpoint_state`): model, optimizer, schedule, batch sampler and global
random generators, the backend's state (the engine's adaptive thresholds and step count), the steps done and
accounted, and the record's history. It is a dict of tensors and plain Python values, read with
``torch.load(weights_only=True)``: loading a checkpoint runs no code.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from dpexp.config import ConfigError

CHECKPOINT_DIR = "checkpoints"
FORMAT = 1  # the layout of the checkpoint dict; a change that old checkpoints cannot follow increments it
_NAME = re.compile(r"step_(\d+)\.pt")


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a run writes checkpoints besides the one on an interrupt: every ``every`` steps and/or every
    ``every_minutes`` minutes (None: never), keeping the last ``keep``; and at the epochs ``at_epochs``,
    each of those kept whatever ``keep`` says."""

    every: int | None = None
    every_minutes: float | None = None
    keep: int = 2
    at_epochs: tuple[float, ...] = ()

    @classmethod
    def from_config(cls, node: DictConfig) -> CheckpointPolicy:
        """The ``checkpoint`` config node, its values checked."""
        every, minutes, keep = node.every, node.every_minutes, node.keep
        if every is not None and every < 1:
            raise ConfigError(f"checkpoint.every must be a number of steps >= 1, or null; got {every}.")
        if minutes is not None and not (minutes > 0 and math.isfinite(minutes)):
            raise ConfigError(f"checkpoint.every_minutes must be a number > 0, or null; got {minutes}.")
        if keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1 (the checkpoints kept), got {keep}.")
        at_epochs = tuple(float(e) for e in (node.get("at_epochs") or ()))
        if not all(e >= 0 and math.isfinite(e) for e in at_epochs):
            raise ConfigError(
                f"checkpoint.at_epochs must be a list of epochs >= 0 (0: before the first step), or null; "
                f"got {list(at_epochs)}."
            )
        return cls(every, minutes, keep, at_epochs)

    def steps_at_epochs(self, sample_rate: float, steps: int) -> dict[float, int]:
        """The step of every epoch of ``at_epochs`` in a run of ``steps`` steps at sample rate ``sample_rate``
        (:func:`epoch_step`); an epoch beyond the run is refused."""
        kept = {epoch: epoch_step(epoch, sample_rate) for epoch in self.at_epochs}
        beyond = [epoch for epoch, step in kept.items() if step > steps]
        if beyond:
            raise ConfigError(
                f"checkpoint.at_epochs={list(self.at_epochs)}: epochs {beyond} come after the run's last "
                f"step ({steps} steps, {steps * sample_rate:g} epochs); keep only epochs it reaches."
            )
        return kept


def epoch_step(epoch: float, sample_rate: float) -> int:
    """The step at which ``epoch`` passes over the data are done, ``round(epoch / q)``, as the plan turns
    ``epochs`` into steps (:func:`dpexp.training.plan.plan_run`)."""
    return round(epoch / sample_rate)


class Checkpointer:
    """Writes the checkpoints of the run in ``run_dir`` by ``policy``; those of ``kept_steps`` (the steps of
    ``checkpoint.at_epochs``: :meth:`CheckpointPolicy.steps_at_epochs`) are written and never removed."""

    def __init__(
        self, run_dir: str | os.PathLike, policy: CheckpointPolicy, kept_steps: frozenset[int] = frozenset()
    ) -> None:
        self.run_dir = Path(run_dir)
        self.policy = policy
        self.kept_steps = frozenset(kept_steps)
        self._last_save = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the policy asks for a checkpoint after ``step``."""
        every, minutes = self.policy.every, self.policy.every_minutes
        by_steps = (every is not None and step % every == 0) or step in self.kept_steps
        return by_steps or (minutes is not None and time.monotonic() - self._last_save >= 60 * minutes)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` and drop all but the last ``keep`` of those not in
        ``kept_steps``; its path."""
        path = checkpoint_path(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".pt.tmp")
        with tmp.open("wb") as handle:
            torch.save({"format": FORMAT, "step": step, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
        self._last_save = time.monotonic()
        ordinary = [p for p in checkpoints(self.run_dir) if _step_of(p) not in self.kept_steps]
        for old in ordinary[: -self.policy.keep]:
            old.unlink()
        return path


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` of the run in ``run_dir`` is (or would be) written."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def _step_of(path: Path) -> int:
    return int(_NAME.fullmatch(path.name).group(1))


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints in ``run_dir``, oldest step first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("step_*.pt") if (m := _NAME.fullmatch(p.name))]
    return [path for _, path in sorted(found)]


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint read with ``weights_only=True``, on the CPU (``load_state_dict`` moves it)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(
            f"{path} is a checkpoint of format {state.get('format')}, this version of dpexp reads {FORMAT}."
        )
    return state
