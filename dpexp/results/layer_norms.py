"""Per-example, per-layer gradient norms of a model at its kept checkpoints (He et al. 2023, sec. 3.2,
Figure 2; app. B).

He et al. take checkpoints at several epochs of a model trained with adaptive per-layer clipping at
epsilon = 8, pick 32 random training examples and show, for each checkpoint, every example's gradient norm
in every layer (rows: examples; columns: layers, input to output). The experiment ``he2023_figure2`` keeps
the checkpoints (``checkpoint.at_epochs``) and :func:`figure` draws them.

**A diagnostic outside the privacy guarantee.** These norms are computed from training examples, exactly
and without noise; training never releases them (they are in no ``metrics.json``), and the figure that
shows them is not differentially private. He et al. plot them for analysis only, and so does this module.

Layers are the clipping groups of per-layer clipping (:func:`dpexp.privacy.grouping.partition` with
``per_layer`` over :func:`dpexp.privacy.capture.discover_layers`: one group per module that owns trainable
parameters, weight and bias together), in the order the model registers them, labelled ``"k module.path"``
like the recorded adaptive thresholds. The per-example gradients come from ``torch.func`` (``vmap`` of
``grad`` of the task's per-example loss over a batch of one), in float64 accumulation; an example's gradient
is what the engine clips for it, for models whose examples do not interact (the engine verifies that when it
trains them). The model is in eval mode: no dropout mask is drawn (the models of Figure 2 have none).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.func import functional_call, grad, vmap

from dpexp.privacy.capture import discover_layers, parameter_layout
from dpexp.privacy.grouping import group_label, partition
from dpexp.training.checkpoint import CheckpointPolicy, checkpoint_path, load_checkpoint
from dpexp.training.loop import instantiate  # the trainer's own construction of a task and a model
from dpexp.training.parameters import select_trained
from dpexp.training.record import METRICS_FILE

PerExampleLoss = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]  # (model, batch) -> (b,)
CAPTION = (
    "Diagnostic outside the privacy guarantee: exact, noiseless per-example gradient norms of training "
    "examples, read from the run's checkpoints after training (He et al. 2023 plot them for analysis); "
    "training never releases them."
)


def layer_groups(model: nn.Module) -> tuple[list[list[str]], list[str]]:
    """The per-layer clipping groups of ``model`` (lists of parameter names, K of them, in model order) and
    their labels ``"k module.path"``."""
    layers, params = discover_layers(model, generic_fallback=True)
    groups = partition(parameter_layout(layers, params), "per_layer")
    return groups, [group_label(k, names) for k, names in enumerate(groups)]


class _Functional:
    """``model`` called with the given parameters (``torch.func.functional_call``); every other attribute
    is the model's, so a task's ``per_example_loss(model, batch)`` runs on it unchanged."""

    def __init__(self, model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        self._model, self._tensors = model, tensors

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self._model, dict(self._tensors), args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def per_layer_norms(
    model: nn.Module,
    per_example_loss: PerExampleLoss,
    batch: Mapping[str, torch.Tensor],
    chunk: int = 32,
) -> tuple[torch.Tensor, list[str]]:
    """Every example's gradient norm in every layer: ``norms[i, k] = ||grad_{theta_k} loss_i||_2``.

    Args:
        model: the network (its trainable parameters are differentiated; it is put in eval mode).
        per_example_loss: ``(model, batch) -> (b,)`` losses, e.g. a task's ``per_example_loss``.
        batch: a dict of batch-first tensors of ``n`` examples (a task's ``collate``).
        chunk: examples per ``vmap`` call (memory: ``chunk`` x the number of parameters).

    Returns:
        ``norms`` of shape ``(n, K)``, float64, and the K layer labels (:func:`layer_groups`).
    """
    groups, labels = layer_groups(model)
    model.eval()
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    others = [*model.named_parameters(), *model.named_buffers()]
    fixed = {n: t.detach() for n, t in others if n not in trainable}  # frozen parameters and buffers

    def loss_of(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
        one = {key: value.unsqueeze(0) for key, value in example.items()}  # a batch of one example
        return per_example_loss(_Functional(model, {**fixed, **params}), one)[0]

    per_example = vmap(grad(loss_of), in_dims=(None, 0))
    size = len(next(iter(batch.values())))
    rows = []
    for start in range(0, size, chunk):
        part = {key: value[start : start + chunk] for key, value in batch.items()}
        grads = per_example(trainable, part)
        squares = {n: g.flatten(1).to(torch.float64).square().sum(dim=1) for n, g in grads.items()}
        rows.append(torch.stack([sum(squares[n] for n in names) for names in groups], dim=1).sqrt())
    return torch.cat(rows), labels


@dataclass(frozen=True)
class CheckpointNorms:
    """Per-layer gradient norms of the same examples at each kept checkpoint of one run."""

    run_dir: str
    epochs: list[float]  # the checkpoints' epochs (checkpoint.at_epochs), ascending
    steps: list[int]  # their steps
    norms: list[np.ndarray]  # one (n, K) float64 array per checkpoint, rows in the order of ``examples``
    layers: list[str]  # the K layer labels, input to output
    examples: list[int]  # the n training-set indices drawn
    classes: list[int | None]  # each example's label (None: the task has none)


def sample_examples(size: int, count: int, seed: int) -> list[int]:
    """``count`` distinct training indices out of ``size``, drawn with a generator seeded by ``seed``."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def kept_checkpoints(run_dir: str | Path) -> dict[float, Path]:
    """The checkpoints a completed run kept by ``checkpoint.at_epochs``: epoch -> path (the run's record
    gives the epochs, its sample rate and steps); a missing one is refused, naming it."""
    record = json.loads((Path(run_dir) / METRICS_FILE).read_text())
    policy = CheckpointPolicy.from_config(OmegaConf.create(record["config"]["checkpoint"]))
    if not policy.at_epochs:
        raise FileNotFoundError(f"{run_dir}: the run kept no checkpoints (checkpoint.at_epochs is not set)")
    steps = policy.steps_at_epochs(float(record["sample_rate"]), int(record["steps"]))
    paths = {epoch: checkpoint_path(run_dir, step) for epoch, step in sorted(steps.items())}
    missing = [epoch for epoch, path in paths.items() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir}: no checkpoint of epochs {missing} (checkpoint.at_epochs)")
    return paths


def checkpoint_norms(run_dir: str | Path, examples: int = 32, seed: int = 0) -> CheckpointNorms:
    """The per-layer gradient norms (:func:`per_layer_norms`) of ``examples`` training examples, drawn with
    ``seed`` (:func:`sample_examples`), at every checkpoint the run in ``run_dir`` kept
    (:func:`kept_checkpoints`); the model and task are rebuilt from the run's recorded config, on the CPU."""
    paths = kept_checkpoints(run_dir)
    cfg: DictConfig = OmegaConf.create(json.loads((Path(run_dir) / METRICS_FILE).read_text())["config"])
    task = instantiate(cfg.task, "task")
    factory = instantiate(cfg.model, "model")
    task.setup(factory)
    model = factory.build(task.info)
    trained = cfg.get("parameters") or {}  # the layers the run trained (a record older than the key: all)
    select_trained(model, trained.get("train"), trained.get("freeze", []))
    dataset = task.train_dataset
    indices = sample_examples(len(dataset), examples, seed)
    chosen = [dataset[i] for i in indices]
    batch = task.collate(chosen)
    try:
        classes: list[int | None] = [int(task.label_of(example)) for example in chosen]
    except NotImplementedError:
        classes = [None] * len(chosen)
    norms, steps, layers = [], [], []
    for path in paths.values():
        state = load_checkpoint(path)
        model.load_state_dict(state["model"])
        values, layers = per_layer_norms(model, task.per_example_loss, batch)
        norms.append(values.numpy())
        steps.append(int(state["step"]))
    return CheckpointNorms(str(run_dir), list(paths), steps, norms, layers, indices, classes)


def figure(spec: DictConfig, scale: str, rows: Sequence[Any], path: Path) -> bool:
    """He et al.'s Figure 2 for ``spec.layer_norms`` (``row``: the table row whose run kept checkpoints,
    ``examples``, ``seed``) from ``rows`` (:func:`dpexp.results.tables.current_histories`): that row's first
    seed's run, one heatmap per kept checkpoint (:func:`dpexp.results.tables.layer_norm_figure`). False
    (nothing written) when the row has no current run, or its run kept no checkpoints (said on stderr)."""
    from dpexp.results.tables import layer_norm_figure

    options = spec.layer_norms
    found = [r for r in rows if r.row.get("key") == options.row and r.run_dirs]
    if not found:
        return False
    run_dir = found[0].run_dirs[0]
    try:
        result = checkpoint_norms(run_dir, int(options.get("examples", 32)), int(options.get("seed", 0)))
    except FileNotFoundError as error:
        print(f"layer-norm figure not drawn: {error}", file=sys.stderr)
        return False
    steps = zip(result.epochs, result.steps, strict=True)
    panels = [f"epoch {epoch:g} (step {step})" for epoch, step in steps]
    examples = [
        f"#{index}" + ("" if label is None else f" ({label})")
        for index, label in zip(result.examples, result.classes, strict=True)
    ]
    title = f"{spec.title.split(':')[0]} ({scale}): {found[0].row.label}, per-layer gradient norms"
    return layer_norm_figure(result.norms, panels, result.layers, examples, path, title, CAPTION)
