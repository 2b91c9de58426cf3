"""Extension points of a training run: what a caller may change or observe without touching the loop (the
privacy audit, ``python -m dpexp.audit``, is built on them)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import Dataset

from dpexp.backends import TrainingBackend
from dpexp.tasks.base import Task


class RunHooks:
    """Called by :func:`dpexp.training.loop.run_training` at fixed points; every method does nothing here."""

    def training_set(self, task: Task, dataset: Dataset) -> Dataset:
        """The private training set the run uses (its length is the N of the accounting)."""
        return dataset

    def backend_ready(self, backend: TrainingBackend, sample_rate: float) -> None:
        """The backend is built (its optimizer attached); ``sample_rate`` is q = B / N."""

    def before_step(self, step: int) -> None:
        """Logical step ``step`` (from 1) has processed its micro-batches and is about to be privatised."""

    def finished(self, model: nn.Module, task: Task) -> dict[str, Any]:
        """Training is over; the fields returned are added to the run record."""
        return {}
