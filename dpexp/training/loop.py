"""The generic (DP-)training loop behind ``python -m dpexp.train``.

One run: build the task and model from config, solve the noise multiplier sigma for the target (epsilon,
delta) at sampling rate q = B/N over T steps with the chosen accountant (an upper bound, rdp or prv, unless
the GDP approximation is opted into: :func:`calibration_accountant`), then T logical steps of
DP-SGD/DP-Adam (Abadi et al. 2016): each logical batch (Poisson-sampled by default) is split into physical
micro-batches whose clipped gradients the backend accumulates, and one ``backend.step()`` adds the noise once
and divides by the expected B. Evaluations every ``eval_every`` steps and at the end go to metrics.json
(:mod:`dpexp.training.record`), which also records the epsilon spent under all three accountants (each
computed under memory and time limits: :mod:`dpexp.training.budget`) and what each of them is
(``epsilon_kind``: upper bound or approximation).

However the run ends, its record says so: ``completed``, ``failed`` (an error), ``diverged`` (a non-finite
loss or parameter: the run stops at the first one) or ``interrupted`` (SIGTERM or SIGINT, handled at a step
boundary: :mod:`dpexp.training.signals`), with the steps done and the epsilon they spent. Checkpoints
(:mod:`dpexp.training.checkpoint`: periodic ones and one on an interrupt) let ``resume`` continue the run in
its own directory, every step accounted exactly once (:meth:`_Run.restore`).
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from dpexp.backends import build_backend
from dpexp.config import ConfigError, check_config
from dpexp.models.base import ModelFactory
from dpexp.privacy import accounting
from dpexp.runtime import machine, process_code_version, resolve_device
from dpexp.tasks.base import Task
from dpexp.training.budget import PrivacyBudget, accounting_limits
from dpexp.training.checkpoint import Checkpointer, CheckpointPolicy, checkpoints, load_checkpoint
from dpexp.training.distributed import DataParallel, start_data_parallel
from dpexp.training.hooks import RunHooks
from dpexp.training.individual import check_individual, individual_of, privacy_groups
from dpexp.training.optim import (
    build_optimizer,
    build_scheduler,
    check_optim_values,
    effective_lr,
    optimizer_report,
)
from dpexp.training.parameters import select_trained
from dpexp.training.pipeline import (
    build_pipeline_backend,
    check_pipeline_config,
    evaluate_whole,
    stage_of,
)
from dpexp.training.plan import (
    RunPlan,
    calibration_accountant,
    check_noise,
    check_run_keys,
    direct_noise_multiplier,
    plan_run,
    target_epsilon,
)
from dpexp.training.record import (
    DIVERGED,
    FAILED,
    INTERRUPTED,
    RUNNING,
    RunRecord,
    WandbSink,
    peak_memory,
    reset_peak_memory,
)
from dpexp.training.rng import rng_state, seed_everything, set_rng_state
from dpexp.training.sampling import build_batch_sampler, split_micro_batches
from dpexp.training.sharded import model_shards, optimizer_shards, shard_model, unsharded
from dpexp.training.signals import InterruptGuard, RunInterrupted

log = logging.getLogger(__name__)


class TrainingDiverged(FloatingPointError):
    """The training loss or the parameters became non-finite."""


def instantiate(node: DictConfig, group: str) -> Any:
    """``hydra.utils.instantiate`` of a task or model node, with plain Python containers; a constructor's
    ValueError (an invalid option) becomes a ConfigError naming the config group."""
    try:
        return hydra.utils.instantiate(node, _convert_="all")
    except InstantiationException as error:
        if isinstance(error.__cause__, ValueError):
            raise ConfigError(f"{group} ({node._target_}): {error.__cause__}") from error.__cause__
        raise


def run_training(
    cfg: DictConfig,
    output_dir: str | Path,
    choices: Mapping[str, str] | None = None,
    hooks: RunHooks | None = None,
    *,
    resume: bool = False,
) -> dict[str, Any]:
    """Train as configured and write ``output_dir/metrics.json``; return the record.

    ``choices`` are the selected config-group options (Hydra's runtime choices), recorded as the run's task,
    model, clip, accountant and optim names; ``hooks`` observe or change the run at fixed points
    (:class:`~dpexp.training.hooks.RunHooks`). ``resume``: continue the run recorded in ``output_dir``
    (``cfg`` is its config: :func:`dpexp.training.resume.load_run_config`) from its latest checkpoint, or from
    the start if it has none. A new run refuses a directory that holds another run's record. If the run fails,
    diverges or is interrupted, the record says so and the exception is re-raised. The record keeps the
    ``code_version`` of the process that started the run (:func:`dpexp.runtime.process_code_version`) and
    the ``machine`` it started on (:func:`dpexp.runtime.machine`); a resume by other code is appended to
    ``resumed_by_code``, one on another machine to ``resumed_on``.
    """
    started = time.perf_counter()
    with InterruptGuard() as guard:
        device = resolve_device(cfg.device)
        parallel = start_data_parallel(cfg.get("distributed"), device)
        writer = parallel is None or parallel.rank == 0  # only rank 0 writes the record and checkpoints
        record: RunRecord | None = None
        run: _Run | None = None
        try:
            with guard.step():  # a signal waits until the run exists to record it (raised at the block's end)
                code, computer = process_code_version(), machine(device)
                if resume:
                    record = RunRecord.reopen(output_dir, writer=writer)
                    if record.data.get("code_version", {}).get("source_hash") != code["source_hash"]:
                        record.update(resumed_by_code=[*record.data.get("resumed_by_code", []), code])
                    if record.data.get("machine") != computer:
                        record.update(resumed_on=[*record.data.get("resumed_on", []), computer])
                else:
                    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
                    fields = {"seed": cfg.seed, "sampling": _choice(cfg.sampling), "code_version": code}
                    fields["machine"] = computer
                    record = RunRecord.create(output_dir, {**fields, "config": resolved}, writer=writer)
                run = _Run(cfg, record, dict(choices or {}), hooks or RunHooks(), started, parallel)
            run.run(guard, resume)
        except BaseException as error:
            if run is not None:
                run.stop(error)
            raise
        finally:
            if run is not None:
                run.close()
            if record is not None:
                record.close()
            if parallel is not None:
                parallel.close()
    return record.data


class _Run:
    """State of one training run; :meth:`run` fills ``record``."""

    def __init__(
        self,
        cfg: DictConfig,
        record: RunRecord,
        choices: dict[str, str],
        hooks: RunHooks,
        started: float,
        parallel: DataParallel | None = None,
    ) -> None:
        self.cfg = cfg
        self.parallel = parallel  # this process' rank of a distributed job (distributed=ddp|fsdp|pipeline)
        # distributed=fsdp: the parameters and optimizer state are sharded, so a checkpoint gathers them on
        # every rank (rank 0 alone writes it) and the ranks agree on when to stop and to checkpoint
        self.sharded = parallel is not None and parallel.sharded
        # distributed=pipeline: every rank trains one stage of the model (dpexp.training.pipeline); the same
        # agreements as fsdp, and a checkpoint gathers every stage's part to rank 0
        self.pipelined = parallel is not None and parallel.pipelined
        self.lockstep = self.sharded or self.pipelined  # every rank holds a part of the state
        self.record = record
        self.choices = choices
        self.hooks = hooks
        self.started = started  # perf_counter() when this process took the run up
        self.device: torch.device | None = None
        self.plan: RunPlan | None = None
        self.privacy_groups: torch.Tensor | None = None  # every training example's privacy group (IDP)
        self.budget: PrivacyBudget | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # distributed=pipeline and a generation task: rank 0's copy of the whole model, which evaluates
        self.whole_model: torch.nn.Module | None = None
        self.step = 0  # logical steps done
        self.steps_accounted = 0  # steps whose privacy is spent: step, plus steps redone with fresh noise
        self.examples = 0
        self.train_time = 0.0  # seconds spent in training steps (the clock runs from self._tick)
        self.wall_time_before = 0.0  # wall time of a resumed run's earlier sessions, up to its checkpoint
        self._tick = 0.0
        self.train_loss: float | None = None  # mean per-example loss of the previous progress window
        self.window_loss = torch.zeros(())  # summed loss and examples since then
        self.window_count = 0
        self._at_boundary = False  # the state is complete and between two steps: it can be checkpointed

    # ------------------------------------------------------------------ the run
    def run(self, guard: InterruptGuard, resume: bool) -> None:
        self._build(resume)
        try:
            if resume:
                self.restore()
            self._at_boundary = True
            self._train(guard)
        except RunInterrupted as interrupt:
            if self._at_boundary and not interrupt.mid_step and (self.record.writer or self.lockstep):
                self.save_checkpoint()
            raise
        finally:
            self._at_boundary = False
            self.backend.close()
        self.record.complete(**self._progress(), **self._spent())

    def _build(self, resume: bool) -> None:
        """Check the config, load the data, build the model, solve the plan, wrap the optimizer."""
        cfg = self.cfg
        check_config(cfg)
        self.device = resolve_device(cfg.device)
        if self.parallel is not None:  # cuda -> this rank's GPU
            self.device = self.parallel.training_device
        calibration_accountant(cfg)  # refuse values that cannot work before loading any data
        target_epsilon(cfg)
        check_noise(cfg)
        direct_noise_multiplier(cfg)
        check_run_keys(cfg)
        check_individual(cfg)
        check_optim_values(cfg.optim)
        if self.pipelined:
            check_pipeline_config(cfg, self.parallel.world_size)
        if _choice(cfg.logger) == "wandb" and self.record.writer:
            resolved = self.record.data["config"]
            wandb = cfg.wandb
            self.record.add_sink(
                WandbSink(wandb.project, wandb.entity, wandb.mode, wandb.group, resolved, self.run_dir)
            )
        checkpointing = CheckpointPolicy.from_config(cfg.checkpoint)  # refused before any data is loaded
        self.budget = PrivacyBudget(accounting_limits(cfg.privacy))
        seed_everything(cfg.seed)
        self.task: Task = instantiate(cfg.task, "task")
        factory: ModelFactory = instantiate(cfg.model, "model")
        self.task.setup(factory)
        self.model = factory.build(self.task.info).to(self.device)
        trained = select_trained(self.model, cfg.parameters.train, cfg.parameters.freeze)
        if self.parallel is not None:
            self.parallel.broadcast_module(self.model)
        if self.sharded:  # every rank keeps its shard of rank 0's parameters (FSDP2)
            shard_model(self.model)
        if self.pipelined:  # every rank keeps the modules of its stage
            if self.task.info.kind == "generation" and self.parallel.rank == 0:  # evaluates the whole model
                self.whole_model = copy.deepcopy(self.model)
            self.model = stage_of(self.model, self.parallel)
        self.model.train()
        self.dataset = self.hooks.training_set(self.task, self.task.train_dataset)
        self.privacy_groups = privacy_groups(cfg, self.task, self.dataset)
        self.plan = plan_run(
            cfg,
            len(self.dataset),
            self.budget.noise_multiplier,
            self.budget.steps_within_budget,
            self.privacy_groups,
            self.budget.calibrate_individual,
        )
        kept = checkpointing.steps_at_epochs(self.plan.sample_rate, self.plan.steps)  # checkpoint.at_epochs
        self.checkpointer = Checkpointer(self.run_dir, checkpointing, frozenset(kept.values()))
        names = {
            "task": self.task.name,
            "model": type(factory).__name__,
            "clip": cfg.clip.name,
            "accountant": cfg.accountant.name,
            "optim": cfg.optim.name,
        }
        names.update({k: v for k, v in self.choices.items() if k in names})
        fields = {
            **names,
            **asdict(self.plan),
            **trained.record(),
            "epsilon_kind": dict(accounting.EPSILON_KINDS),
        }
        tokenizer = factory.tokenizer_record()
        if tokenizer is not None:  # where the vocabulary came from, and whether it saw the training data
            fields["tokenizer"] = tokenizer
        fields.update(self.task.record_fields())  # e.g. the canaries inserted into the training set
        if resume:  # the record keeps what the run recorded first
            fields = {k: v for k, v in fields.items() if k not in self.record.data}
        self.record.update(**fields, device=str(self.device))
        self.record.write()
        if self.plan.noise_multipliers and _choice(cfg.sampling) == "shuffle":
            warnings.warn(
                "sampling=shuffle: the accountants assume Poisson subsampling; epsilon is only indicative.",
                stacklevel=1,
            )

        individual = individual_of(self.plan.individual)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim.schedule, self.plan.steps)
        plan = self.plan
        noise_multiplier = (
            plan.noise_multiplier if plan.noise_schedule == "constant" else plan.noise_multipliers
        )
        if self.pipelined:
            self.backend = build_pipeline_backend(
                cfg.clip,
                module=self.model,
                optimizer=self.optimizer,
                batch_size=plan.batch_size,
                sample_size=plan.sample_size,
                noise_multiplier=noise_multiplier,
                seed=int(cfg.seed),
                timeout_s=self.parallel.timeout_s,
            )
            self.model = self.backend.model  # the stage, whose forward runs the whole pipeline
        else:
            self.backend = build_backend(
                cfg.clip,
                model=self.model,
                optimizer=self.optimizer,
                batch_size=plan.batch_size,
                sample_size=plan.sample_size,
                noise_multiplier=noise_multiplier,
                individual=individual,
                aggregation=self.parallel,
                sharded=self.sharded,
            )
        sampling_rates = individual is not None and individual.variant == "sampling"
        self.sampler = build_batch_sampler(
            _choice(cfg.sampling),
            sample_size=self.plan.sample_size,
            batch_size=self.plan.batch_size,
            steps=self.plan.steps,
            generator=torch.Generator().manual_seed(int(cfg.seed)),
            example_rates=(
                torch.tensor(individual.sample_rates, dtype=torch.float64)[self.privacy_groups]
                if sampling_rates
                else None
            ),
        )
        self.window_loss = torch.zeros((), device=self.device)
        self.hooks.backend_ready(self.backend, self.plan.sample_rate)

    def _train(self, guard: InterruptGuard) -> None:
        cfg, plan = self.cfg, self.plan
        reset_peak_memory(self.device)
        bar = tqdm(
            total=plan.steps,
            initial=self.step,
            disable=not cfg.progress or not self.record.writer,
            desc=self.record.data["task"],
            dynamic_ncols=True,
        )
        lengths = self._example_lengths() if cfg.group_by_length else None
        batches = iter(self.sampler)
        self._tick = time.perf_counter()
        try:
            if self.step:  # resumed: the step of the checkpoint may have stopped before its report
                self._report(bar)
            elif 0 in self.checkpointer.kept_steps and (self.record.writer or self.sharded):
                with self._outside_training():  # checkpoint.at_epochs holds 0: the model before training
                    self.save_checkpoint()
            while self.step < plan.steps:
                with guard.step(self._agree_on_signal if self.lockstep else None):
                    self._train_step(next(batches), lengths)
                bar.update()
                self._report(bar)
                if (self.record.writer or self.lockstep) and self._checkpoint_due():
                    with self._outside_training():
                        self.save_checkpoint()
        finally:
            bar.close()
        self.model.eval()
        with torch.no_grad():
            self.record.update(**self.hooks.finished(self.model, self.task))
        self.model.train()

    def _train_step(self, indices: list[int], lengths: list[int] | None) -> None:
        """One logical step: micro-batches, the privatised update, the counters; stops a diverged run. Under
        data parallelism this rank runs its share of the batch; the loss is summed over the ranks. A pipeline
        stage runs the whole batch (through its modules) and every stage has the whole loss."""
        step_loss = torch.zeros((), device=self.device)
        share = indices if self.parallel is None else self.parallel.share(indices)
        with unsharded(self.model) if self.sharded else nullcontext():  # fsdp: one all-gather per step
            for micro in split_micro_batches(share, self.plan.physical_batch_size, lengths):
                batch = _to_device(self.task.collate([self.dataset[i] for i in micro]), self.device)
                loss = self.backend.per_example_loss(self.task.per_example_loss, batch)
                groups = None if self.privacy_groups is None else self.privacy_groups[micro].to(self.device)
                self.backend.backward(loss, privacy_groups=groups)
                step_loss += loss.detach().sum()
        self.hooks.before_step(self.step + 1)
        self.backend.step()
        if self.parallel is not None and not self.pipelined:
            self.parallel.sum_([step_loss])
        if self.parallel is not None and not self.lockstep:
            # fsdp: nothing to compare, every coordinate of a parameter (and of its optimizer state) is held
            # by one rank only, and every rank's forward all-gathers those same shards
            self.parallel.check_same("the parameters after the step", self.params)
        self.scheduler.step()
        self.step += 1
        self.steps_accounted += 1
        self.examples += len(indices)
        self.window_loss += step_loss
        self.window_count += len(indices)
        self._check_finite(step_loss)

    def _check_finite(self, step_loss: torch.Tensor) -> None:
        lr = f"optim.lr={self.cfg.optim.lr:g}"
        if not bool(torch.isfinite(step_loss)):
            raise TrainingDiverged(
                f"the training loss of step {self.step} is {float(step_loss)} ({lr}); lower optim.lr"
            )
        if not self._parameters_finite():
            raise TrainingDiverged(
                f"the parameters became non-finite at step {self.step} ({lr}); lower optim.lr"
            )

    def _parameters_finite(self) -> bool:
        """Whether every parameter is finite; sharded (fsdp): every rank's shards, a pipeline: every stage's
        parameters, agreed by all ranks."""
        if not self.lockstep:
            return bool(torch.isfinite(torch.nn.utils.get_total_norm(self.params, norm_type=math.inf)))
        local = [p.to_local() for p in self.params] if self.sharded else self.params
        finite = all(bool(torch.isfinite(t).all()) for t in local)
        return self.parallel.largest("checking the parameters are finite", float(not finite)) == 0

    def _agree_on_signal(self, signum: int) -> int:
        """fsdp and pipeline: the signal any rank received in this step (0: none), so that all ranks stop
        after the same step and gather its checkpoint together."""
        return int(self.parallel.largest("agreeing whether to stop", float(signum)))

    def _checkpoint_due(self) -> bool:
        """Whether to checkpoint after this step; fsdp and pipeline: rank 0's decision on every rank (its
        clock, with checkpoint.every_minutes), since every rank gathers the state."""
        due = self.checkpointer.due(self.step)
        if self.lockstep and self.checkpointer.policy.every_minutes is not None:
            rank0 = float(due) if self.record.writer else 0.0
            due = self.parallel.largest("agreeing whether to checkpoint", rank0) > 0
        return due

    def _report(self, bar: tqdm) -> None:
        """Progress and evaluation after a step, as configured. Doing it twice changes nothing (the window is
        empty the second time, an evaluation of the step is not repeated), so a resumed run can always redo
        the report of the step it resumes at."""
        cfg, plan, step = self.cfg, self.plan, self.step
        last = step == plan.steps
        if step % cfg.log_every == 0 or last:
            with self._outside_training():
                if self.window_count:
                    self.train_loss = float(self.window_loss) / self.window_count
                self.window_loss.zero_()
                self.window_count = 0
                epsilon = self.budget.epsilon(plan, self._accounted(), cfg.accountant.name)
                throughput = round(self.examples / max(self.train_time, 1e-9))
                bar.set_postfix(loss=self.train_loss, eps=epsilon, ex_per_s=throughput, refresh=False)
                if bar.disable and self.record.writer:  # no bar (progress=false, a sweep): the log has it
                    log.info(
                        "step %d/%d: train loss %s, epsilon %s, %d examples/s",
                        step, plan.steps, _number(self.train_loss), _number(epsilon), throughput,
                    )  # fmt: skip
        history = self.record.data["history"]
        evaluated = bool(history) and history[-1]["step"] == step
        if ((cfg.eval_every and step % cfg.eval_every == 0) or last) and not evaluated:
            with self._outside_training():
                self._evaluate()

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

    def _evaluate(self) -> None:
        self.model.eval()
        with torch.no_grad():
            if self.pipelined and self.task.info.kind == "generation":  # beam search: the whole model
                metrics = evaluate_whole(
                    self.task, self.model, self.whole_model, self.parallel, int(self.cfg.eval_batch_size)
                )
            else:
                metrics = self.task.evaluate(self.model, int(self.cfg.eval_batch_size))
        self.model.train()
        entry = {
            "step": self.step,
            "epoch": self.step * self.plan.sample_rate,
            "epsilon": self.budget.epsilon(self.plan, self._accounted(), self.cfg.accountant.name),
            "train_loss": self.train_loss,
            "lr": effective_lr(self.optimizer, self.scheduler),
            "examples_seen": self.examples,
            "train_time_s": self.train_time,
            **self.backend.released(),
        }
        self.record.update(**self._counts())
        self.record.log_eval(entry, metrics)
        if self.record.writer:
            log.info(
                "evaluation at step %d (epoch %.2f, epsilon %s): %s",
                self.step, entry["epoch"], _number(entry["epsilon"]),
                ", ".join(f"{name} {_number(value)}" for name, value in metrics.items()),
            )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints and resume
    @property
    def run_dir(self) -> Path:
        return self.record.path.parent

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Everything the run needs to go on from this step boundary as if it had never stopped. A pipeline:
        the model's state whole (every stage's part), the optimizer's, the engine's and the generators' as
        lists by stage; gathered to rank 0 (a collective on every rank; None on the others)."""
        model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        backend, rng = self.backend.state_dict(), rng_state()
        if self.sharded:  # the full state, as one process holds it (a collective on every rank)
            model, optimizer = self.parallel.full_state(model), self.parallel.full_state(optimizer)
        if self.pipelined:
            parts = {"model": model, "optimizer": optimizer, "backend": backend, "rng": rng}
            stages = self.parallel.gather("gathering the stages' checkpoint", parts)
            if stages is None:
                return None
            model = {key: value for stage in stages for key, value in stage["model"].items()}
            optimizer, backend, rng = (
                [stage[part] for stage in stages] for part in ("optimizer", "backend", "rng")
            )
        return {
            "plan": asdict(self.plan),
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "backend": backend,
            "rng": rng,
            "progress": {
                "steps_accounted": self.steps_accounted,
                "examples": self.examples,
                "train_time_s": self.train_time,
                "wall_time_s": self._wall_time(),
                "train_loss": self.train_loss,
                "window_loss": self.window_loss.detach().cpu().clone(),
                "window_count": self.window_count,
            },
            "evaluations": self.record.evaluations(),
        }

    def save_checkpoint(self) -> None:
        """Write the checkpoint of this step: rank 0 alone; under fsdp and pipeline every rank calls it (they
        all gather the state) and the others stop there."""
        state = self.checkpoint_state()
        if not self.record.writer:
            return
        path = self.checkpointer.save(self.step, state)
        self.record.update(checkpoint=str(path.relative_to(self.run_dir)), **self._counts())
        self.record.write()
        log.info("checkpoint of step %d: %s", self.step, path)

    def restore(self) -> None:
        """Continue from the latest checkpoint (or from the start), accounting every step exactly once.

        The steps the record shows beyond the checkpoint are done again. They draw the same batches and the
        same noise, and so release nothing new, unless the noise is not reproducible (``secure_mode``): then
        the steps of the released record beyond the checkpoint are accounted again.
        """
        recorded = int(self.record.data.get("steps_done", 0))
        found = checkpoints(self.run_dir)
        named = self.record.data.get("checkpoint")
        if named and not (self.run_dir / named).is_file():
            log.warning(
                "%s: the record's checkpoint %s is missing; continuing from %s",
                self.run_dir,
                named,
                found[-1].name if found else "the start",
            )
        if found:
            state = load_checkpoint(found[-1])
            if state["plan"] != asdict(self.plan):
                raise ValueError(
                    f"resume: {found[-1]} was written for the plan {state['plan']}, this run plans "
                    f"{asdict(self.plan)}: its data or its code changed, so it is not the same run."
                )
            backend, rng = state["backend"], state["rng"]
            if self.sharded:  # every rank read the full state and keeps its own shards
                self.model.load_state_dict(model_shards(self.model, state["model"]))
                self.optimizer.load_state_dict(optimizer_shards(self.optimizer, state["optimizer"]))
            elif self.pipelined:  # every stage read the whole state and keeps its own part
                rank = self.parallel.rank
                self.model.load_state_dict({key: state["model"][key] for key in self.model.state_dict()})
                self.optimizer.load_state_dict(state["optimizer"][rank])
                backend, rng = backend[rank], rng[rank]
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.sampler.load_state_dict(state["sampler"])
            self.backend.load_state_dict(backend)
            set_rng_state(rng)
            progress = state["progress"]
            self.step = state["step"]
            self.steps_accounted = progress["steps_accounted"]
            self.examples = progress["examples"]
            self.train_time = progress["train_time_s"]
            self.wall_time_before = progress["wall_time_s"]
            self.train_loss = progress["train_loss"]
            self.window_loss = progress["window_loss"].to(self.device)
            self.window_count = progress["window_count"]
            self.record.rewind(state["evaluations"])
        else:
            self.record.rewind({"history": [], "metrics": {}})
        secure = bool(OmegaConf.select(self.cfg, "clip.engine.secure_mode", default=False))
        again = max(0, recorded - self.step) if secure else 0
        self.steps_accounted += again
        resumes = self.record.data.get("resumes", [])
        resumes.append({"from_step": self.step, "recorded_steps": recorded, "accounted_again": again})
        self.record.update(status=RUNNING, error=None, resumes=resumes, **self._counts())
        self.record.write()
        log.info(
            "resuming %s at step %d of %d (%d steps accounted again)",
            self.run_dir,
            self.step,
            self.plan.steps,
            again,
        )

    # ------------------------------------------------------------------ the end
    def stop(self, error: BaseException) -> None:
        """Record how the run ended and what it had done: at once, then with the epsilon it spent."""
        if isinstance(error, RunInterrupted):
            status = INTERRUPTED
        elif isinstance(error, FloatingPointError):
            status = DIVERGED
        else:
            status = FAILED
        self.record.update(status=status, error=f"{type(error).__name__}: {error}", **self._progress())
        self.record.write(strict=False)
        self.record.fail(error, status, **self._spent())

    def close(self) -> None:
        if self.budget is not None:
            self.budget.close()

    def _counts(self) -> dict[str, Any]:
        return {
            "steps_done": self.step,
            "steps_accounted": self.steps_accounted,
            "examples_seen": self.examples,
            **optimizer_report(self.optimizer),
        }

    def _progress(self) -> dict[str, Any]:
        """What the run did and measured so far (the latest training loss includes the open window)."""
        latest = float(self.window_loss) / self.window_count if self.window_count else self.train_loss
        fields = {
            **self._counts(),
            "train_loss": latest,
            "throughput_examples_per_s": self.examples / max(self.train_time, 1e-9),
            "train_time_s": self.train_time,
            "wall_time_s": self._wall_time(),
        }
        if self.device is not None:
            fields["peak_memory_bytes"], fields["peak_memory_kind"] = peak_memory(self.device)
        return fields

    def _spent(self) -> dict[str, Any]:
        """Epsilon of the steps accounted under every accountant, and the accountants that failed."""
        if self.plan is None:
            return {}
        epsilons, errors = self.budget.epsilons(self.plan, self._accounted())
        if self.plan.individual is None:
            return {"epsilon": epsilons, "epsilon_errors": errors}
        by_group, group_errors = self.budget.epsilons_by_group(self.plan, self._accounted())
        return {
            "epsilon": epsilons,
            "epsilon_by_group": by_group,
            "epsilon_errors": {**group_errors, **errors},
        }

    def _accounted(self) -> list[float]:
        """The noise multiplier of every step whose privacy is spent (``steps_accounted`` of them): steps
        0..step-1, and the first runs of the steps a secure-mode resume redid with fresh noise."""
        sigmas = self.plan.noise_multipliers
        redone = [
            sigma
            for resume in self.record.data.get("resumes", [])
            for sigma in sigmas[resume["from_step"] : resume["from_step"] + resume["accounted_again"]]
        ]
        return sigmas[: self.step] + redone

    def _wall_time(self) -> float:
        return self.wall_time_before + time.perf_counter() - self.started


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def _choice(value: Any) -> str:
    """The string of an enum-typed config value (the schema in dpexp/config.py types them as str Enums)."""
    return str(getattr(value, "value", value))


def _number(value: float | None) -> str:
    """A logged value: four significant digits, ``-`` for none (no loss yet, a non-private run's epsilon)."""
    return "-" if value is None else f"{value:.4g}"
