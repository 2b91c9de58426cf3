"""The contract between the trainer and tasks (the task-model contract is :mod:`dpexp.models.base`).

Data flows one way: ``config -> Task + ModelFactory -> model -> privacy backend -> trainer``.
A task knows its data, its per-example loss and its metric; it knows nothing about clipping.
A model factory knows how to build a network (and its tokenizer) for a task; it knows nothing
about privacy either.

The trainer drives them as::

    task = hydra.utils.instantiate(cfg.task)          # a Task
    factory = hydra.utils.instantiate(cfg.model)      # a ModelFactory
    task.setup(factory)                               # load + preprocess data (fails early)
    model = factory.build(task.info)                  # an nn.Module
    loss = task.per_example_loss(model, batch)        # shape (B,)
    metrics = task.evaluate(model, batch_size)        # {"accuracy": ...}
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dpexp.models.base import ModelFactory, TaskInfo


class Task(ABC):
    """A data set with its per-example loss and its evaluation metric."""

    name: str = "task"

    @abstractmethod
    def setup(self, factory: ModelFactory) -> None:
        """Load and preprocess the data; must raise a clear error (missing file, bad column) here."""

    @property
    @abstractmethod
    def info(self) -> TaskInfo:
        """Shape information for the model factory (valid after :meth:`setup`)."""

    @property
    @abstractmethod
    def train_dataset(self) -> Dataset:
        """The private training set; its length is the N of the privacy accounting."""

    @abstractmethod
    def collate(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        """Turn a list of training examples into a batch (a dict of batch-first tensors)."""

    def example_length(self, example: Any) -> int | None:
        """The padded size a training example contributes (its token count), or None when all examples have
        the same size. The trainer groups micro-batches by it (``group_by_length``)."""
        return None

    @abstractmethod
    def per_example_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One loss per example, shape (B,). Sequence tasks sum their token losses (Li et al. 2022)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """Task metrics on the held-out split(s), e.g. ``{"accuracy": 0.91}``."""

    def record_fields(self) -> dict[str, Any]:
        """Fields the run record keeps about the task's data once set up (e.g. the canaries a generation
        task inserted into its training set); none by default."""
        return {}

    def relabelled(self, example: Any, label: int) -> Any:
        """A copy of a training example with another label (the black-box privacy audit's mislabelled
        canaries); classification tasks implement it."""
        raise NotImplementedError(
            f"task {self.name} cannot relabel its examples for input canaries; audit it with audit=white_box"
        )

    def column_value(self, example: Any, column: str) -> Any:
        """The value of a training example's ``column`` (``privacy.individual.column``: its privacy group);
        every classification task has ``label``."""
        if column == "label":
            return self.label_of(example)
        raise ValueError(f"task {self.name} has no column {column!r} (classification tasks have label)")

    def label_of(self, example: Any) -> int:
        """The label of a training example (classification tasks)."""
        raise NotImplementedError(f"task {self.name} has no labels")
