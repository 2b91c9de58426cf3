"""The contract between the trainer, tasks and models.

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
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

TaskKind = Literal["classification", "generation"]


@dataclass
class TaskInfo:
    """What a model factory needs to know about a task to build a matching network."""

    kind: TaskKind
    num_labels: int | None = None  # classification tasks
    vocab_size: int | None = None  # text tasks (size of the tokenizer actually used)
    pad_token_id: int | None = None
    max_length: int | None = None  # longest tokenised input the task produces
    input_shape: tuple[int, ...] | None = None  # vision tasks: (C, H, W)
    extra: dict[str, Any] = field(default_factory=dict)


class ModelFactory(ABC):
    """Builds a model (and, for text models, provides the tokenizer the task must use)."""

    def tokenizer(self) -> Any | None:
        """The tokenizer this model expects, or None for non-text models."""
        return None

    @abstractmethod
    def build(self, info: TaskInfo) -> nn.Module:
        """Return a freshly initialised (or pretrained) model for the task described by ``info``.

        Raise ``ValueError`` naming both sides when the model cannot serve this kind of task.
        """


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
