"""He et al. 2023, Figure 2: per-example, per-layer gradient norms (dpexp/results/layer_norms.py) equal a
brute-force loop of one backward per example, and the figure is drawn from the checkpoints the run kept at
its epochs, for the sampled training examples."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from dpexp.results import layer_norms, tables
from dpexp.results.tables import RowHistory
from dpexp.runtime import code_version
from dpexp.training.checkpoint import checkpoint_path, load_checkpoint
from dpexp.training.loop import instantiate, run_training
from dpexp.training.rng import seed_everything
from tests.conftest import CONF_DIR, REPO_ROOT, composed


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def test_norms_equal_one_backward_per_example_layer_by_layer_in_float64() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    ).double()
    model[1].bias.requires_grad_(False)  # a frozen parameter belongs to no layer's norm
    batch = {"x": torch.randn(7, 1, 6, 6, dtype=torch.float64), "y": torch.randint(0, 3, (7,))}
    norms, labels = layer_norms.per_layer_norms(model, _loss, batch, chunk=3)  # three vmap calls
    assert labels == ["0 0", "1 1.weight", "2 4"] and norms.shape == (7, 3) and norms.dtype == torch.float64
    layers = [[model[0].weight, model[0].bias], [model[1].weight], [model[4].weight, model[4].bias]]
    expected = torch.zeros(7, 3, dtype=torch.float64)
    for i in range(7):
        one = {key: value[i : i + 1] for key, value in batch.items()}
        grads = torch.autograd.grad(_loss(model, one)[0], [p for layer in layers for p in layer])
        squares = iter(g.square().sum() for g in grads)
        for k, layer in enumerate(layers):
            expected[i, k] = sum(next(squares) for _ in layer).sqrt()
    torch.testing.assert_close(norms, expected, rtol=1e-12, atol=0.0)
    assert (norms > 0).all()


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs of the digits default (q = 1/3: 3 steps an epoch) keeping epochs 0, 1 and 2."""
    overrides = ["epochs=2", "batch_size=479", "physical_batch_size=479", "progress=false",
                 "eval_every=null", "checkpoint.at_epochs=[0,1,2]"]  # fmt: skip
    cfg = composed(overrides)
    run_dir = tmp_path_factory.mktemp("kept")
    run_training(cfg, run_dir)
    return run_dir


SPEC = OmegaConf.create(
    {
        "title": "He et al. 2023, Figure 2: test",
        "layer_norms": {"row": "adaptive", "examples": 5, "seed": 3},
        "rows": [{"label": "Adaptive per-layer", "key": "adaptive"}, {"label": "Other", "key": "other"}],
    }
)


def test_the_heatmaps_are_those_of_the_kept_checkpoints_for_the_sampled_examples(
    kept_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = {}

    def capture(norms, panels, layers, examples, path, title, caption) -> bool:
        drawn.update(norms=norms, panels=panels, layers=layers, examples=examples, caption=caption)
        return True

    monkeypatch.setattr(tables, "layer_norm_figure", capture)
    rows = [
        RowHistory(1, SPEC.rows[1], [], None, [[]], [str(tmp_path / "elsewhere")]),
        RowHistory(0, SPEC.rows[0], [], None, [[]], [str(kept_run)]),
    ]
    assert layer_norms.figure(SPEC, "offline", rows, tmp_path / "f.png")
    assert drawn["panels"] == ["epoch 0 (step 0)", "epoch 1 (step 3)", "epoch 2 (step 6)"]
    assert drawn["layers"] == [
        "0 0",
        "1 1",
        "2 3",
        "3 4",
        "4 7",
    ]  # the small CNN: conv, norm, conv, norm, linear
    assert "outside the privacy guarantee" in drawn["caption"]

    # the examples: 5 training indices drawn with seed 3, labelled with their classes
    task = instantiate(OmegaConf.load(CONF_DIR / "task" / "digits.yaml"), "task")
    factory = instantiate(OmegaConf.load(CONF_DIR / "model" / "small_cnn.yaml"), "model")
    task.setup(factory)
    indices = layer_norms.sample_examples(len(task.train_dataset), 5, 3)
    chosen = [task.train_dataset[i] for i in indices]
    assert drawn["examples"] == [f"#{i} ({task.label_of(e)})" for i, e in zip(indices, chosen, strict=True)]

    # each panel: the norms of the model of its own checkpoint; epoch 0 is the model the seed initialised
    batch = task.collate(chosen)
    model = factory.build(task.info)
    for panel, step in zip(drawn["norms"], (0, 3, 6), strict=True):
        model.load_state_dict(load_checkpoint(checkpoint_path(kept_run, step))["model"])
        np.testing.assert_array_equal(
            panel, layer_norms.per_layer_norms(model, task.per_example_loss, batch)[0]
        )
    seed_everything(0)
    initial = factory.build(task.info)
    np.testing.assert_array_equal(drawn["norms"][0], layer_norms.per_layer_norms(initial, _digits, batch)[0])
    assert not np.array_equal(drawn["norms"][0], drawn["norms"][2])  # training moved the model


def _digits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]), batch["label"], reduction="none")


def test_the_figure_is_written_and_a_run_without_kept_checkpoints_draws_none(
    kept_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "figures" / "f.png"
    assert layer_norms.figure(
        SPEC, "offline", [RowHistory(0, SPEC.rows[0], [], None, [[]], [str(kept_run)])], path
    )
    assert path.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "lost").mkdir()
    (tmp_path / "lost" / "metrics.json").write_text((kept_run / "metrics.json").read_text())
    lost = [RowHistory(0, SPEC.rows[0], [], None, [[]], [str(tmp_path / "lost")])]
    assert not layer_norms.figure(SPEC, "offline", lost, tmp_path / "none.png")
    assert "no checkpoint of epochs [0.0, 1.0, 2.0]" in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists()
    assert not layer_norms.figure(SPEC, "offline", [], tmp_path / "none.png")  # no current run of the row


def test_layer_norm_figure_refuses_norms_of_the_wrong_shape(tmp_path: Path) -> None:
    norms = [np.ones((3, 2)), np.ones((2, 3))]
    with pytest.raises(ValueError, match=r"epoch 1: norms of shape \(2, 3\), expected \(3, 2\)"):
        tables.layer_norm_figure(
            norms, ["epoch 0", "epoch 1"], ["a", "b"], ["x", "y", "z"], tmp_path / "f.png", "t", "c"
        )
    assert not tables.layer_norm_figure([], [], ["a"], ["x"], tmp_path / "f.png", "t", "c")


def test_the_norms_of_a_run_that_froze_layers_are_those_of_the_layers_it_trained(tmp_path: Path) -> None:
    """The model is rebuilt with the run's ``parameters`` selection: its frozen first convolution and norm
    have no row, the layers it trained keep theirs."""
    overrides = ["epochs=1", "batch_size=479", "physical_batch_size=479", "progress=false", "eval_every=null",
                 "checkpoint.at_epochs=[0,1]", "parameters.freeze=['0.*','1.*']"]  # fmt: skip
    cfg = composed(overrides)
    run_training(cfg, tmp_path)
    kept = layer_norms.checkpoint_norms(tmp_path, examples=4)
    assert kept.layers == ["0 3", "1 4", "2 7"] and all(n.shape == (4, 3) for n in kept.norms)


def test_the_committed_figure_runs_keep_their_checkpoints_in_git() -> None:
    """`make figures` on a fresh clone draws He et al.'s Figure 2 from the current code's run, so that run's
    kept checkpoints must travel with its record: results/runs/.gitignore lets he2023_figure2's checkpoints
    into git and keeps every other run's out (stop 74 found the current run's left out, and rendering deleted
    the figure on a fresh clone)."""
    runs = REPO_ROOT / "results" / "runs"
    figure_run = runs / "he2023_figure2" / "offline" / "a-run" / "checkpoints" / "step_00000000.pt"
    other_run = runs / "he2023_table11b" / "offline" / "a-run" / "checkpoints" / "step_00000000.pt"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", str(figure_run), str(other_run)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ignored.stdout.split() == [str(other_run)], ignored.stderr
    source = code_version()["source_hash"]
    for path in runs.glob("he2023_figure2/*/*/metrics.json"):
        record = json.loads(path.read_text())
        if record.get("code_version", {}).get("source_hash") != source:
            continue
        if record["config"]["checkpoint"].get("at_epochs"):
            assert layer_norms.kept_checkpoints(path.parent)  # refuses, naming them, if any is missing
