"""MNIST digit classification (LeCun et al. 1998): 60,000 training and 10,000 test images, 28x28 grey.

The data set of the survey's experiments (Monir et al. 2024, sec. 6: Table 8, Figure 11, the MNIST results of
sec. 6.2). Everything but the reading of the files is CIFAR-10's (:class:`dpexp.tasks.cifar10.Cifar10Task`):
``split``, ``subsample``, test ``accuracy`` and ``train_accuracy``; batches hold raw pixels in [0, 1],
``image`` (B, 1, 28, 28), and ``label`` (B,).

Data come from the Hugging Face hub (``ylecun/mnist``) unless a local copy is given: ``path`` (the folder of
the four files) or ``data_root`` (the folder containing ``MNIST/raw/``, torchvision's layout), in the original
IDX format, each file gzipped (``.gz``, as released) or not: ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``. An IDX file is a
big-endian header (two zero bytes, the type code 0x08 for unsigned bytes, the number of dimensions, then each
dimension as a 4-byte integer) followed by the data.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from dpexp.models.base import TaskInfo
from dpexp.tasks.cifar10 import Cifar10Task
from dpexp.tasks.hub import load_hub_images

HUB_DATASET = "ylecun/mnist"
FOLDER = Path("MNIST") / "raw"
HUB_FIX = f"Offline, set data.root to a folder containing {FOLDER}/ (the original IDX files)."
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
UNSIGNED_BYTE = 0x08  # the IDX type code of the release's data


class MnistTask(Cifar10Task):
    """MNIST; the arguments are :class:`Cifar10Task`'s (``data_root``: the folder containing ``MNIST/raw/``;
    ``path``: the folder of the four IDX files)."""

    name = "mnist"

    def _local_dir(self) -> Path | None:
        if self.path is not None:
            return Path(self.path)
        return None if self.data_root is None else Path(self.data_root) / FOLDER

    def _read(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``train`` or ``test`` split: uint8 images (n, 1, 28, 28) and int64 labels (n,)."""
        folder = self._local_dir()
        if folder is None:
            return load_hub_images(HUB_DATASET, split, "image", "L", HUB_FIX)
        image_file, label_file = FILES[split]
        images, labels = read_idx(folder / image_file), read_idx(folder / label_file)
        if images.ndim != 3 or images.shape[1:] != IMAGE_SHAPE[1:] or labels.ndim != 1:
            raise ValueError(
                f"{folder / image_file}: expected images (n, 28, 28) and labels (n,), got {images.shape} "
                f"and {labels.shape}."
            )
        if len(images) != len(labels) or len(labels) == 0 or labels.max() >= NUM_CLASSES:
            raise ValueError(
                f"{folder / label_file}: expected one label in 0..9 for each of the {len(images)} images, "
                f"got {len(labels)} labels (largest {labels.max() if len(labels) else None})."
            )
        return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))

    @property
    def info(self) -> TaskInfo:
        return TaskInfo(self.name, "classification", num_labels=NUM_CLASSES, input_shape=IMAGE_SHAPE)


def read_idx(file: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (``file`` or ``file.gz``) -> uint8 array of the header's shape."""
    gz = file.with_name(file.name + ".gz")
    if not file.is_file() and not gz.is_file():
        raise FileNotFoundError(
            f"{file} (or {gz.name}) not found: the mnist task reads the original IDX release "
            f"({', '.join(name for pair in FILES.values() for name in pair)}, gzipped or not). Put them "
            f"in data.root/{FOLDER}, set task.path to their folder, or set data.root=null to download from "
            "the hub."
        )
    raw = file.read_bytes() if file.is_file() else gzip.decompress(gz.read_bytes())
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != UNSIGNED_BYTE or raw[3] == 0:
        raise ValueError(f"{file}: not an IDX file of unsigned bytes (header {raw[:4].hex()}).")
    dims = raw[3]
    header = 4 + 4 * dims
    shape = tuple(int.from_bytes(raw[4 + 4 * k : 8 + 4 * k], "big") for k in range(dims))
    if len(raw) != header + int(np.prod(shape)):
        raise ValueError(f"{file}: the header's shape {shape} needs {int(np.prod(shape))} bytes of data, "
                         f"the file holds {len(raw) - header}.")  # fmt: skip
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
