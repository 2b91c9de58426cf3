"""MNIST task on a tiny data set written in the original IDX format (gzipped, as released, or plain)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from dpexp.models.cnn import SmallCNNFactory
from dpexp.tasks.mnist import FILES, FOLDER, MnistTask, read_idx
from dpexp.training.loop import run_training
from tests.conftest import TINY_RUN

TRAIN_SIZE, TEST_SIZE = 40, 7


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` (uint8) as an IDX file: two zero bytes, type 0x08, the number of dimensions, the sizes."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder: Path, gzipped: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """Random images and labels of both splits under ``folder`` in the release's file names."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    arrays = {}
    for split, size in (("train", TRAIN_SIZE), ("test", TEST_SIZE)):
        images = rng.integers(0, 256, size=(size, 28, 28), dtype=np.uint8)
        labels = np.arange(size, dtype=np.uint8) % 10
        for name, array in zip(FILES[split], (images, labels), strict=True):
            data = idx_bytes(array)
            if gzipped:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
            arrays[name] = array
    return arrays


@pytest.mark.parametrize("gzipped", [True, False])
def test_idx_files_give_batches_of_the_release_pixels(tmp_path: Path, gzipped: bool) -> None:
    arrays = write_mnist(tmp_path / FOLDER, gzipped)
    task = MnistTask(data_root=str(tmp_path))
    task.setup(SmallCNNFactory())
    assert len(task.train_dataset) == TRAIN_SIZE and len(task.eval_dataset) == TEST_SIZE
    assert task.info.input_shape == (1, 28, 28) and task.info.num_labels == 10 and task.name == "mnist"
    batch = task.collate([task.train_dataset[i] for i in range(3)])
    assert batch["image"].shape == (3, 1, 28, 28) and batch["image"].dtype == torch.float32
    expected = torch.from_numpy(arrays["train-images-idx3-ubyte"][:3]).float().unsqueeze(1) / 255
    assert torch.equal(batch["image"], expected)
    assert batch["label"].tolist() == arrays["train-labels-idx1-ubyte"][:3].tolist()
    test_labels = torch.stack([label for _, label in task.eval_dataset])
    assert test_labels.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_path_subsample_and_tune_split(tmp_path: Path) -> None:
    write_mnist(tmp_path / "files", gzipped=False)
    task = MnistTask(path=str(tmp_path / "files"), split="tune", subsample=10)
    task.setup(SmallCNNFactory())
    assert len(task.train_dataset) == 10 and len(task.eval_dataset) == TRAIN_SIZE // 5


def test_a_private_run_trains_on_the_local_files(tmp_path: Path, compose_config) -> None:
    write_mnist(tmp_path / "data" / FOLDER)
    cfg = compose_config(
        ["task=mnist", "model=small_cnn", "clip=bk", f"data.root={tmp_path / 'data'}", *TINY_RUN]
    )
    record = run_training(cfg, tmp_path / "run")
    assert record["status"] == "completed" and record["sample_size"] == TRAIN_SIZE
    assert 0.0 <= record["accuracy"] <= 1.0 and record["epsilon"]["rdp"] <= cfg.privacy.epsilon + 1e-6


def test_missing_and_malformed_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte \(or .*\.gz\) not found.*IDX"):
        MnistTask(data_root=str(tmp_path)).setup(SmallCNNFactory())
    folder = tmp_path / FOLDER
    write_mnist(folder, gzipped=False)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(TEST_SIZE - 1, 3, dtype=np.uint8)))
    with pytest.raises(
        ValueError, match=r"t10k-labels-idx1-ubyte: expected one label in 0..9 for each of the 7"
    ):
        MnistTask(data_root=str(tmp_path)).setup(SmallCNNFactory())
    (folder / "bad").write_bytes(bytes([0, 0, 0x0D, 1]) + (4).to_bytes(4, "big") + bytes(16))  # float32
    with pytest.raises(ValueError, match="not an IDX file of unsigned bytes"):
        read_idx(folder / "bad")
    (folder / "short").write_bytes(idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8))[:-5])
    with pytest.raises(
        ValueError, match=r"shape \(2, 28, 28\) needs 1568 bytes of data, the file holds 1563"
    ):
        read_idx(folder / "short")


def test_hub_failure_explains_the_offline_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"ylecun/mnist \(train\).*no network.*MNIST/raw"):
        MnistTask().setup(SmallCNNFactory())


@pytest.mark.parametrize(("mode", "channels"), [("L", 1), ("RGB", 3)])
def test_hub_images_become_uint8_nchw(monkeypatch: pytest.MonkeyPatch, mode: str, channels: int) -> None:
    """The hub path (scale=paper): PIL images of any mode become uint8 (N, C, H, W) in the asked mode."""
    import datasets
    from PIL import Image

    from dpexp.tasks.hub import load_hub_images

    pixels = np.arange(2 * 5 * 4 * 3, dtype=np.uint8).reshape(2, 5, 4, 3)
    fake = {"picture": [Image.fromarray(p, "RGB") for p in pixels], "label": [3, 7]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: fake)
    images, labels = load_hub_images("some/set", "train", "picture", mode, "unused")
    assert images.dtype == torch.uint8 and images.shape == (2, channels, 5, 4)
    assert labels.tolist() == [3, 7]
    if mode == "RGB":
        assert torch.equal(images, torch.from_numpy(pixels).permute(0, 3, 1, 2))
