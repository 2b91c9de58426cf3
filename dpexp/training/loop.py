"""The generic (DP-)training loop behind ``python -m dpexp.train``.

One run: build the task and model from config, solve the noise multiplier sigma for the target (epsilon,
delta) at sampling rate q = B/N over T steps with the chosen accountant (an upper bound, rdp or prv, unless
the GDP approximation is opted into: :func:`calibration_accountant`), then T logical steps of
DP-SGD/DP-Adam (Abadi et al. 2016): each logical batch (Poisson-sampled by default) is split into physical
micro-batches whose clipped gradients the backend accumulates, and one ``backend.step()`` adds the noise once
and divides by the expected B. Evaluations every ``eval_every`` steps and at the end go to metrics.json
(:mod:`dpexp.training.record`), which also records the epsilon spent under all three accountants and what each
of them is (``epsilon_kind``: upper bound or approximation).
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from dpexp.backends import build_backend
from dpexp.config import check_config
from dpexp.models.base import ModelFactory
from dpexp.privacy import accounting
from dpexp.runtime import resolve_device
from dpexp.tasks.base import Task
from dpexp.training.hooks import RunHooks
from dpexp.training.optim import build_optimizer, build_scheduler
from dpexp.training.plan import calibration_accountant, plan_run, spent_epsilon
from dpexp.training.record import RunRecord, WandbSink, peak_memory, reset_peak_memory
from dpexp.training.sampling import build_batch_sampler, split_micro_batches

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) so that CPU runs are reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def instantiate(node: DictConfig) -> Any:
    """``hydra.utils.instantiate`` of a task or model node, with plain Python containers."""
    return hydra.utils.instantiate(node, _convert_="all")


def run_training(
    cfg: DictConfig,
    output_dir: str | Path,
    choices: Mapping[str, str] | None = None,
    hooks: RunHooks | None = None,
) -> dict[str, Any]:
    """Train as configured and write ``output_dir/metrics.json``; return the record.

    ``choices`` are the selected config-group options (Hydra's runtime choices), recorded as the run's task,
    model, clip, accountant and optim names; ``hooks`` observe or change the run at fixed points
    (:class:`~dpexp.training.hooks.RunHooks`). On failure the record is written with ``status: failed`` and
    the error is re-raised.
    """
    started = time.perf_counter()
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    record = RunRecord(output_dir, {"seed": cfg.seed, "sampling": _choice(cfg.sampling), "config": resolved})
    try:
        check_config(cfg)
        if _choice(cfg.logger) == "wandb":
            record.add_sink(
                WandbSink(cfg.wandb.project, cfg.wandb.entity, cfg.wandb.mode, resolved, Path(output_dir))
            )
        _Run(cfg, record, dict(choices or {}), hooks or RunHooks()).run()
    except BaseException as error:
        record.fail(error, wall_time_s=time.perf_counter() - started)
        raise
    record.complete(wall_time_s=time.perf_counter() - started)
    return record.data


class _Run:
    """State of one training run; :meth:`run` fills ``record``."""

    def __init__(self, cfg: DictConfig, record: RunRecord, choices: dict[str, str], hooks: RunHooks) -> None:
        self.cfg = cfg
        self.record = record
        self.choices = choices
        self.hooks = hooks
        self.device = resolve_device(cfg.device)
        self.train_time = 0.0  # seconds spent in training steps (the clock runs from self._tick)
        self._tick = 0.0
        self.examples = 0
        self.train_loss: float | None = None  # mean per-example loss since the previous progress update

    def run(self) -> None:
        cfg = self.cfg
        calibration_accountant(cfg)  # refuse an uncalibratable accountant before loading any data
        seed_everything(cfg.seed)
        self.task: Task = instantiate(cfg.task)
        factory: ModelFactory = instantiate(cfg.model)
        self.task.setup(factory)
        self.model = factory.build(self.task.info).to(self.device)
        self.model.train()
        self.dataset = self.hooks.training_set(self.task, self.task.train_dataset)
        self.plan = plan_run(cfg, len(self.dataset))
        names = {
            "task": self.task.name,
            "model": type(factory).__name__,
            "clip": cfg.clip.name,
            "accountant": cfg.accountant.name,
            "optim": cfg.optim.name,
        }
        names.update({k: v for k, v in self.choices.items() if k in names})
        self.record.update(
            **names, **asdict(self.plan), epsilon_kind=dict(accounting.EPSILON_KINDS), device=str(self.device)
        )
        self.record.write()
        if self.plan.target_epsilon is not None and _choice(cfg.sampling) == "shuffle":
            warnings.warn(
                "sampling=shuffle: the accountants assume Poisson subsampling; epsilon is only indicative.",
                stacklevel=1,
            )

        optimizer = build_optimizer((p for p in self.model.parameters() if p.requires_grad), cfg.optim)
        self.scheduler = build_scheduler(optimizer, cfg.optim.schedule, self.plan.steps)
        self.backend = build_backend(
            cfg.clip,
            model=self.model,
            optimizer=optimizer,
            batch_size=self.plan.batch_size,
            sample_size=self.plan.sample_size,
            noise_multiplier=self.plan.noise_multiplier,
        )
        self.hooks.backend_ready(self.backend, self.plan.sample_rate)
        try:
            self._train()
        finally:
            self.backend.close()

    def _train(self) -> None:
        cfg, plan = self.cfg, self.plan
        generator = torch.Generator().manual_seed(int(cfg.seed))
        sampler = build_batch_sampler(
            _choice(cfg.sampling),
            sample_size=plan.sample_size,
            batch_size=plan.batch_size,
            steps=plan.steps,
            generator=generator,
        )
        reset_peak_memory(self.device)
        bar = tqdm(
            total=plan.steps, disable=not cfg.progress, desc=self.record.data["task"], dynamic_ncols=True
        )
        window_loss = torch.zeros((), device=self.device)
        window_count = 0
        self._tick = time.perf_counter()
        lengths = self._example_lengths() if cfg.group_by_length else None
        for step, indices in enumerate(sampler, start=1):
            for micro in split_micro_batches(indices, plan.physical_batch_size, lengths):
                batch = _to_device(self.task.collate([self.dataset[i] for i in micro]), self.device)
                loss = self.task.per_example_loss(self.backend.model, batch)
                self.backend.backward(loss)
                window_loss += loss.detach().sum()
                window_count += len(micro)
            self.hooks.before_step(step)
            self.backend.step()
            self.scheduler.step()
            self.examples += len(indices)
            bar.update()
            if step % cfg.log_every == 0 or step == plan.steps:
                with self._outside_training():
                    if window_count:
                        self.train_loss = float(window_loss) / window_count
                    window_loss.zero_()
                    window_count = 0
                    bar.set_postfix(
                        loss=self.train_loss,
                        eps=spent_epsilon(plan, step, cfg.accountant.name),
                        ex_per_s=round(self.examples / max(self.train_time, 1e-9)),
                        refresh=False,
                    )
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == plan.steps:
                with self._outside_training():
                    self._evaluate(step)
        bar.close()
        self.model.eval()
        with torch.no_grad():
            self.record.update(**self.hooks.finished(self.model, self.task))
        self.model.train()
        epsilons, errors = self._final_epsilons()
        memory, memory_kind = peak_memory(self.device)
        self.record.update(
            epsilon=epsilons,
            epsilon_errors=errors,
            throughput_examples_per_s=self.examples / max(self.train_time, 1e-9),
            train_time_s=self.train_time,
            examples_seen=self.examples,
            peak_memory_bytes=memory,
            peak_memory_kind=memory_kind,
        )

    def _example_lengths(self) -> list[int] | None:
        """Every training example's length for grouping micro-batches; None if the task has no lengths
        (decided from the first example, so image tasks never load their whole training set here)."""
        if len(self.dataset) == 0 or self.task.example_length(self.dataset[0]) is None:
            return None
        return [self.task.example_length(self.dataset[i]) for i in range(len(self.dataset))]

    @contextmanager
    def _outside_training(self) -> Iterator[None]:
        """Stop the training clock (throughput counts training only) around logging and evaluation."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_time += time.perf_counter() - self._tick
        yield
        self._tick = time.perf_counter()

    def _evaluate(self, step: int) -> None:
        self.model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(self.model, int(self.cfg.eval_batch_size))
        self.model.train()
        entry = {
            "step": step,
            "epoch": step * self.plan.sample_rate,
            "epsilon": spent_epsilon(self.plan, step, self.cfg.accountant.name),
            "train_loss": self.train_loss,
            "lr": self.scheduler.get_last_lr()[0],
            "examples_seen": self.examples,
            "train_time_s": self.train_time,
        }
        self.record.log_eval(entry, metrics)

    def _final_epsilons(self) -> tuple[dict[str, float | None], dict[str, str]]:
        """Epsilon spent under every accountant; a failing accountant is recorded, not fatal."""
        epsilons: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        for name in accounting.ACCOUNTANTS:
            try:
                epsilons[name] = spent_epsilon(self.plan, self.plan.steps, name)
            except (ValueError, RuntimeError, ArithmeticError) as error:
                epsilons[name] = None
                errors[name] = f"{type(error).__name__}: {error}"
                log.warning("epsilon under the %s accountant failed: %s", name, error)
        return epsilons, errors


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def _choice(value: Any) -> str:
    """The string of an enum-typed config value (the schema in dpexp/train.py types them as str Enums)."""
    return str(getattr(value, "value", value))
