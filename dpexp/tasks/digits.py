"""scikit-learn's handwritten digits: the offline default task (8x8 grey images, 10 classes, N_total = 1797).

The data ship with scikit-learn, so the default run needs no download. Pixels (0..16) are mapped to [-1, 1];
a stratified split with a fixed seed holds out ``test_fraction`` of the images for evaluation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.tasks.base import Task

IMAGE_SHAPE = (1, 8, 8)
NUM_CLASSES = 10


class DigitsTask(Task):
    """Classification of the 8x8 digits; batches are ``{"image": (b, 1, 8, 8) float, "label": (b,) long}``."""

    name = "digits"

    def __init__(self, test_fraction: float = 0.2, split_seed: int = 0) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self._train: TensorDataset | None = None
        self._test: TensorDataset | None = None

    def setup(self, factory: ModelFactory) -> None:
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        train_idx, test_idx = train_test_split(
            torch.arange(len(labels)).numpy(),
            test_size=self.test_fraction,
            random_state=self.split_seed,
            stratify=labels.numpy(),
        )
        self._train = TensorDataset(images[train_idx], labels[train_idx])
        self._test = TensorDataset(images[test_idx], labels[test_idx])

    @property
    def info(self) -> TaskInfo:
        return TaskInfo(self.name, "classification", num_labels=NUM_CLASSES, input_shape=IMAGE_SHAPE)

    @property
    def train_dataset(self) -> Dataset:
        return self._require(self._train)

    @property
    def test_dataset(self) -> TensorDataset:
        """The held-out split (same format as the training set)."""
        return self._require(self._test)

    def collate(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        images, labels = zip(*examples, strict=True)
        return {"image": torch.stack(images), "label": torch.stack(labels)}

    def per_example_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of each example, shape (b,)."""
        return F.cross_entropy(model(batch["image"]), batch["label"], reduction="none")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """Test ``accuracy`` and mean test ``loss`` (the trainer calls this in eval mode)."""
        images, labels = self.test_dataset.tensors
        device = next(model.parameters()).device
        correct, loss_sum = 0, 0.0
        for start in range(0, len(labels), batch_size):
            x = images[start : start + batch_size].to(device)
            y = labels[start : start + batch_size].to(device)
            logits = model(x)
            correct += int((logits.argmax(dim=1) == y).sum())
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        return {"accuracy": correct / len(labels), "loss": loss_sum / len(labels)}

    def relabelled(
        self, example: tuple[torch.Tensor, torch.Tensor], label: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return example[0], torch.tensor(label, dtype=torch.long)

    def label_of(self, example: tuple[torch.Tensor, torch.Tensor]) -> int:
        return int(example[1])

    @staticmethod
    def _require(dataset: TensorDataset | None) -> TensorDataset:
        if dataset is None:
            raise RuntimeError("DigitsTask.setup() must be called before using the data.")
        return dataset
