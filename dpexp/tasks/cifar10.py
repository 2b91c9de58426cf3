"""CIFAR-10 image classification (Krizhevsky 2009): 50,000 training and 10,000 test images, 32x32 RGB.

The WRN-16-4 task of De et al. (2022) and He et al. (2023, sec. 5.1, appendix A.1), reporting test accuracy
and training accuracy, and the BK paper's ViT/BEiT fine-tuning runs (Bu et al. 2023). No data augmentation
(He et al. do not use augmentation multiplicity). Batches hold raw pixels in [0, 1], ``image`` (B, 3, 32, 32),
and ``label`` (B,); each model normalises (and, for pretrained transformers, resizes) its input itself.

Data come from the Hugging Face hub (``uoft-cs/cifar10``) unless a local copy is given: ``path`` (the
``cifar-10-batches-py`` folder) or ``data_root`` (the folder containing it), in the original python format
(pickled ``data_batch_1`` ... ``data_batch_5`` and ``test_batch``, each a dict with ``data``, uint8
(n, 3072) in channel-major order, and ``labels``). A pickle can run code when it is loaded; these are read by
a restricted unpickler that builds only what the release holds (dicts, lists, bytes, numbers and NumPy
arrays), so a hostile folder cannot run code through them.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dpexp.metrics.accuracy import accuracy
from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.tasks.base import Task
from dpexp.tasks.hub import load_hub_images
from dpexp.tasks.subsets import check_split_options, training_indices

HUB_DATASET = "uoft-cs/cifar10"
FOLDER = "cifar-10-batches-py"
HUB_FIX = f"Offline, set data.root to a folder containing {FOLDER}/ (the original python release)."
TRAIN_FILES = tuple(f"data_batch_{k}" for k in range(1, 6))
TEST_FILE = "test_batch"
IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
# The only globals a CIFAR-10 batch refers to: NumPy's array reconstruction (numpy.core in the 2009 release;
# numpy._core, _frombuffer and _codecs.encode in copies pickled again by Python 3 and NumPy 2).
SAFE_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
)


class Cifar10Task(Task):
    """CIFAR-10; ``evaluate`` reports test ``accuracy`` and ``train_accuracy`` on a seeded training subset.

    Args:
        data_root: folder containing ``cifar-10-batches-py/``; null loads from the hub.
        path: the ``cifar-10-batches-py`` folder itself (overrides ``data_root``).
        split: ``full`` (train on the 50,000, test on the 10,000) or ``tune`` (train on a seeded 80% of the
            training set, report accuracy on the other 20%; the test set is not loaded).
        tune_fraction: held-out share of the training set for ``split=tune``.
        subsample: keep this many (seeded) training examples, for quick runs; null keeps all.
        data_seed: seed of the tune split, the subsample and the training-accuracy subset.
        train_eval_size: training examples scored for ``train_accuracy`` (all if fewer).
    """

    name = "cifar10"

    def __init__(
        self,
        data_root: str | None = None,
        path: str | None = None,
        split: str = "full",
        tune_fraction: float = 0.2,
        subsample: int | None = None,
        data_seed: int = 0,
        train_eval_size: int = 10_000,
    ) -> None:
        check_split_options(split, tune_fraction, subsample)
        if train_eval_size < 1:
            raise ValueError(f"train_eval_size must be positive, got {train_eval_size}.")
        self.data_root = data_root
        self.path = path
        self.split = split
        self.tune_fraction = tune_fraction
        self.subsample = subsample
        self.data_seed = data_seed
        self.train_eval_size = train_eval_size
        self._train: TensorDataset | None = None
        self._eval: TensorDataset | None = None
        self._train_eval: TensorDataset | None = None

    def setup(self, factory: ModelFactory) -> None:
        images, labels = self._read("train")
        train_idx, heldout_idx = training_indices(
            len(labels), self.split, self.tune_fraction, self.subsample, self.data_seed
        )
        if heldout_idx is None:
            self._eval = TensorDataset(*self._read("test"))
        else:
            self._eval = TensorDataset(images[heldout_idx], labels[heldout_idx])
        self._train = TensorDataset(images[train_idx], labels[train_idx])
        scored = np.random.default_rng(self.data_seed).permutation(len(train_idx))[: self.train_eval_size]
        self._train_eval = TensorDataset(*self._train[torch.from_numpy(np.sort(scored))])

    def _local_dir(self) -> Path | None:
        if self.path is not None:
            return Path(self.path)
        return None if self.data_root is None else Path(self.data_root) / FOLDER

    def _read(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``train`` or ``test`` split: uint8 images (n, 3, 32, 32) and int64 labels (n,). Subclasses for
        other image sets (:mod:`dpexp.tasks.mnist`) override this, ``name`` and ``info``."""
        folder = self._local_dir()
        if folder is None:
            return load_hub_images(HUB_DATASET, split, "img", "RGB", HUB_FIX)
        parts = [
            read_cifar_batch(folder / name) for name in (TRAIN_FILES if split == "train" else (TEST_FILE,))
        ]
        return torch.cat([images for images, _ in parts]), torch.cat([labels for _, labels in parts])

    @property
    def info(self) -> TaskInfo:
        return TaskInfo(self.name, "classification", num_labels=NUM_CLASSES, input_shape=IMAGE_SHAPE)

    @property
    def train_dataset(self) -> Dataset:
        return _require(self._train)

    @property
    def eval_dataset(self) -> TensorDataset:
        """The test set (``split=full``) or the held-out part of the training set (``split=tune``)."""
        return _require(self._eval)

    @property
    def train_eval_dataset(self) -> TensorDataset:
        """The seeded subset of the training set scored for ``train_accuracy``."""
        return _require(self._train_eval)

    def collate(self, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        images, labels = zip(*examples, strict=True)
        return {"image": torch.stack(images).float() / 255.0, "label": torch.stack(labels)}

    def relabelled(
        self, example: tuple[torch.Tensor, torch.Tensor], label: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return example[0], torch.tensor(label, dtype=torch.long)

    def label_of(self, example: tuple[torch.Tensor, torch.Tensor]) -> int:
        return int(example[1])

    @staticmethod
    def logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Class scores (B, 10)."""
        return model(batch["image"])

    def per_example_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross entropy of each example, shape (B,)."""
        return F.cross_entropy(self.logits(model, batch), batch["label"], reduction="none")

    def evaluate(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """Test (or held-out) ``accuracy``; ``train_accuracy`` on up to ``train_eval_size`` train images."""
        return {
            "accuracy": accuracy(model, self.eval_dataset, self.collate, self.logits, batch_size),
            "train_accuracy": accuracy(
                model, _require(self._train_eval), self.collate, self.logits, batch_size
            ),
        }


def read_cifar_batch(file: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch file of the original python release -> uint8 images (n, 3, 32, 32), int64 labels (n,)."""
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} not found: the cifar10 task reads the original python release ({FOLDER}/ with "
            f"{', '.join(TRAIN_FILES)}, {TEST_FILE}). Extract cifar-10-python.tar.gz into data.root, set "
            "task.path to the cifar-10-batches-py folder, or set data.root=null to download from the hub."
        )
    with file.open("rb") as handle:
        batch = _BatchUnpickler(handle, file).load()
    if not isinstance(batch, dict):
        raise ValueError(f"{file}: not a CIFAR-10 python batch (a {type(batch).__name__}, not a dict).")
    batch = {key.decode() if isinstance(key, bytes) else key: value for key, value in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise ValueError(
            f"{file}: not a CIFAR-10 python batch (keys {sorted(batch)}; expected 'data' and 'labels')."
        )
    data, labels = batch["data"], batch["labels"]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2):
        raise ValueError(f"{file}: 'data' must be a uint8 array (n, 3072), got {type(data).__name__}.")
    if data.shape[1] != 3 * 32 * 32 or len(data) == 0 or len(labels) != len(data):
        raise ValueError(
            f"{file}: 'data' must be (n, 3072), n >= 1, with n labels; got {data.shape} and {len(labels)}."
        )
    return torch.from_numpy(data.reshape(-1, *IMAGE_SHAPE).copy()), torch.tensor(labels, dtype=torch.long)


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 batch, refusing every global outside :data:`SAFE_GLOBALS` (a pickle that names
    another one is not from the release and could run code)."""

    def __init__(self, handle: BinaryIO, file: Path) -> None:
        super().__init__(handle, encoding="bytes")
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in SAFE_GLOBALS:
            raise ValueError(
                f"{self.file}: refers to {module}.{name}, which a CIFAR-10 python batch does not hold; not "
                "loading it (a pickle can run code). Use the files of the official release "
                "(https://www.cs.toronto.edu/~kriz/cifar.html)."
            )
        return super().find_class(module.replace("numpy.core.", "numpy._core."), name)


def _require(dataset: TensorDataset | None) -> TensorDataset:
    if dataset is None:
        raise RuntimeError("Cifar10Task.setup() must be called first.")
    return dataset
