"""CIFAR-10 task on a tiny data set written in the original python pickle format."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dpexp.models.wrn import WideResNetFactory
from dpexp.tasks.cifar10 import FOLDER, Cifar10Task

PER_BATCH, TEST_SIZE = 4, 6


def write_cifar(root: Path, seed: int = 0) -> dict[str, dict[bytes, object]]:
    """Five training batches of PER_BATCH images and a test batch, pickled like the official release."""
    rng = np.random.default_rng(seed)
    folder = root / FOLDER
    folder.mkdir(parents=True)
    batches = {}
    for name, size in [*((f"data_batch_{k}", PER_BATCH) for k in range(1, 6)), ("test_batch", TEST_SIZE)]:
        batch = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, size=(size, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, size=size).tolist(),
        }
        with (folder / name).open("wb") as handle:
            pickle.dump(batch, handle)
        batches[name] = batch
    return batches


class MeanColour(nn.Module):
    """A fixed deterministic classifier: logits = per-channel means times a fixed matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.linear(image.mean(dim=(2, 3)))


def expected_accuracy(model: nn.Module, data: np.ndarray, labels: list[int]) -> float:
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32)).float() / 255
    return float((model(images).argmax(1) == torch.tensor(labels)).float().mean())


def test_original_pickles_give_batches_in_channel_major_layout(tmp_path: Path) -> None:
    batches = write_cifar(tmp_path)
    task = Cifar10Task(data_root=str(tmp_path))
    task.setup(WideResNetFactory(width=1))
    assert len(task.train_dataset) == 5 * PER_BATCH
    assert task.info.input_shape == (3, 32, 32) and task.info.num_labels == 10
    batch = task.collate([task.train_dataset[i] for i in range(PER_BATCH + 1)])
    assert batch["image"].shape == (PER_BATCH + 1, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert batch["image"].min() >= 0.0 and batch["image"].max() <= 1.0
    second = batches["data_batch_2"]  # example PER_BATCH is the first image of data_batch_2
    red = torch.from_numpy(second[b"data"][0, :1024].reshape(32, 32)).float() / 255
    torch.testing.assert_close(batch["image"][PER_BATCH, 0], red)
    assert batch["label"][PER_BATCH].item() == second[b"labels"][0]


def test_evaluate_reports_test_and_train_accuracy(tmp_path: Path) -> None:
    batches = write_cifar(tmp_path)
    task = Cifar10Task(data_root=str(tmp_path))
    task.setup(WideResNetFactory(width=1))
    torch.manual_seed(0)
    model = MeanColour()
    metrics = task.evaluate(model, batch_size=4)
    test = batches["test_batch"]
    assert metrics["accuracy"] == pytest.approx(expected_accuracy(model, test[b"data"], test[b"labels"]))
    train_data = np.concatenate([batches[f"data_batch_{k}"][b"data"] for k in range(1, 6)])
    train_labels = [label for k in range(1, 6) for label in batches[f"data_batch_{k}"][b"labels"]]
    assert metrics["train_accuracy"] == pytest.approx(expected_accuracy(model, train_data, train_labels))
    assert model.training  # evaluate restores the mode it found


def test_wrn_per_example_loss_shape(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    task = Cifar10Task(path=str(tmp_path / FOLDER), subsample=6)
    factory = WideResNetFactory(depth=10, width=1)
    task.setup(factory)
    model = factory.build(task.info)
    losses = task.per_example_loss(model, task.collate([task.train_dataset[i] for i in range(6)]))
    assert losses.shape == (6,)
    torch.testing.assert_close(losses, torch.full((6,), float(np.log(10))))  # zero-initialised head


def test_tune_split_and_subsample(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    (tmp_path / FOLDER / "test_batch").unlink()  # the tune split does not read the test set
    task = Cifar10Task(data_root=str(tmp_path), split="tune", train_eval_size=3)
    task.setup(WideResNetFactory(width=1))
    assert len(task.train_dataset) == 16 and len(task.eval_dataset) == 4
    train_images = {bytes(image.numpy()) for image, _ in task.train_dataset}
    assert train_images.isdisjoint(bytes(image.numpy()) for image, _ in task.eval_dataset)
    assert len(task.train_eval_dataset) == 3
    small = Cifar10Task(data_root=str(tmp_path), split="tune", subsample=5)  # same data_seed: same split
    small.setup(WideResNetFactory(width=1))
    assert len(small.train_dataset) == 5 and len(small.eval_dataset) == 4
    assert {bytes(image.numpy()) for image, _ in small.train_dataset} < train_images  # never held-out images


def test_missing_or_malformed_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data_batch_1 not found.*cifar-10-python\.tar\.gz"):
        Cifar10Task(data_root=str(tmp_path)).setup(WideResNetFactory())
    write_cifar(tmp_path)
    with (tmp_path / FOLDER / "data_batch_3").open("wb") as handle:
        pickle.dump({b"images": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0, 1]}, handle)
    with pytest.raises(ValueError, match="data_batch_3: not a CIFAR-10 python batch"):
        Cifar10Task(data_root=str(tmp_path)).setup(WideResNetFactory())
    with pytest.raises(ValueError, match="valid choices: full, tune"):
        Cifar10Task(split="test")


def test_hub_failure_explains_the_offline_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"uoft-cs/cifar10 \(train\).*no network.*cifar-10-batches-py"):
        Cifar10Task().setup(WideResNetFactory())


class RunsCode:
    """What a hostile pickle holds: loading it would call ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_only_what_the_release_holds_is_unpickled(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    marker = tmp_path / "code_ran"
    with (tmp_path / FOLDER / "data_batch_2").open("wb") as handle:
        pickle.dump({b"data": RunsCode(marker), b"labels": [0]}, handle)
    with pytest.raises(ValueError, match=r"data_batch_2: refers to (posix|os)\.system.*not loading it"):
        Cifar10Task(data_root=str(tmp_path)).setup(WideResNetFactory())
    assert not marker.exists()
    with (tmp_path / FOLDER / "data_batch_2").open("wb") as handle:
        pickle.dump({b"data": np.zeros((1, 3072), dtype=object), b"labels": [0]}, handle)
    with pytest.raises(ValueError, match="'data' must be a uint8 array"):
        Cifar10Task(data_root=str(tmp_path)).setup(WideResNetFactory())


def test_the_release_pickle_format_loads(tmp_path: Path) -> None:
    """Protocol 2 with the 2009 release's global names (numpy.core.multiarray); Python 3 writes bytes via
    _codecs.encode in protocol 2, which is allowed too."""
    batches = write_cifar(tmp_path)
    for name, batch in batches.items():
        data = pickle.dumps(batch, protocol=2).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        (tmp_path / FOLDER / name).write_bytes(data)
    task = Cifar10Task(data_root=str(tmp_path))
    task.setup(WideResNetFactory(width=1))
    first = batches["data_batch_1"]
    assert torch.equal(task.train_dataset[0][0].flatten(), torch.from_numpy(first[b"data"][0]))
    assert len(task.eval_dataset) == TEST_SIZE
