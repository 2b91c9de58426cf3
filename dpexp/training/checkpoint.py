"""Checkpoints of a run: ``<run dir>/checkpoints/step_<k>.pt``, written atomically (temporary file, fsync,
rename), the last ``checkpoint.keep`` of them kept.

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
    ``every_minutes`` minutes (None: never), keeping the last ``keep``."""

    every: int | None = None
    every_minutes: float | None = None
    keep: int = 2

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
        return cls(every, minutes, keep)


class Checkpointer:
    """Writes the checkpoints of the run in ``run_dir`` by ``policy``."""

    def __init__(self, run_dir: str | os.PathLike, policy: CheckpointPolicy) -> None:
        self.run_dir = Path(run_dir)
        self.policy = policy
        self._last_save = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the policy asks for a checkpoint after ``step``."""
        every, minutes = self.policy.every, self.policy.every_minutes
        by_steps = every is not None and step % every == 0
        return by_steps or (minutes is not None and time.monotonic() - self._last_save >= 60 * minutes)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` and drop all but the last ``keep``; its path."""
        folder = self.run_dir / CHECKPOINT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step:08d}.pt"
        tmp = path.with_suffix(".pt.tmp")
        with tmp.open("wb") as handle:
            torch.save({"format": FORMAT, "step": step, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
        self._last_save = time.monotonic()
        for old in checkpoints(self.run_dir)[: -self.policy.keep]:
            old.unlink()
        return path


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
