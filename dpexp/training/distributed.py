"""Data-parallel private training on ``torch.distributed`` (``distributed=ddp`` and ``fsdp``, one process per
rank under torchrun; gloo on CPU, NCCL on GPU), and the process group of a pipeline (``distributed=pipeline``,
one process per stage: :mod:`dpexp.training.pipeline`).

Every rank r of P holds the whole model and, per logical step of DP-SGD (Abadi et al. 2016, Algorithm 1):

1. draws the logical batch from the run's seeded sampler, the same Poisson sample over the whole data set on
   every rank; :meth:`DataParallel.share` checks it against rank 0's draw (broadcast) and keeps the share
   ``batch[r::P]``, so every sampled example is clipped by exactly one rank;
2. clips its share with the engine, micro-batch by micro-batch (any clipping mode, bk or ghost);
3. ``backend.step()``: rank 0 alone adds the Gaussian noise to its partial clipped sum, one all-reduce adds
   the P partial sums (:class:`DataParallel` is the engine's
   :class:`~dpexp.privacy.aggregation.StepAggregation`), and every rank divides by the expected B and steps.

The noise is drawn once, by rank 0, rather than by every rank from a shared seed: a shared seed would give
one draw only while every rank's generator stayed in step, which dropout (a different number of
micro-batches per rank) and secure mode (the OS CSPRNG, never seeded) both break; rank 0's draw is one draw
by construction and costs no extra collective. Adaptive thresholds release their clip counts the same way,
so every rank moves its thresholds identically. The plan (N, B, q, T, sigma) is the single process' plan, so
the accounting is identical. Every rank evaluates the (same) model, so that none waits at its next collective
for the evaluation of another; only rank 0 records it and writes the run record and checkpoints.

After every step the ranks compare their parameters (:meth:`DataParallel.check_same`: sums and sums of
squares, one small all-reduce) and stop if they differ: the engine's guarantee holds for one model.

``distributed=fsdp`` runs the same steps on parameters sharded by FSDP2 (:mod:`dpexp.training.sharded`): the
model is sharded after the broadcast, each step all-gathers it once, and :attr:`DataParallel.sharded` tells
the trainer to skip :meth:`~DataParallel.check_same` (every coordinate lives on one rank: no copy can drift),
to gather the full state for checkpoints on every rank (:meth:`~DataParallel.full_state`; rank 0 writes it),
and to agree (:meth:`~DataParallel.largest`) on stopping after a signal, on rank 0's checkpoint clock and on
the parameters' finiteness.

``distributed=pipeline`` uses the same process group for other ends: every stage runs the whole logical
batch (:meth:`DataParallel.share` checks that every stage drew rank 0's batch and keeps all of it), each
through its own modules; :meth:`~DataParallel.largest` agrees on stopping, checkpointing and finiteness, and
:meth:`~DataParallel.gather` brings every stage's state to rank 0, which writes the record and checkpoints.

A rank that fails ends the job instead of hanging it: its peers' next collective fails when its connection
closes, or at the latest after ``distributed.timeout_s``, with a :class:`DistributedError` naming that key.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from dpexp.config import ConfigError
from dpexp.training import sharded

MODES = ("none", "ddp", "fsdp", "pipeline")  # fsdp: dpexp.training.sharded; pipeline: dpexp.training.pipeline
BACKENDS = ("auto", "gloo", "nccl")
TORCHRUN = "torchrun --standalone --nproc-per-node=2 -m dpexp.train distributed={name} ..."


class DistributedError(RuntimeError):
    """A collective of the data-parallel job failed or disagreed: another rank failed or stalled."""


@dataclass(frozen=True)
class DistributedConfig:
    """The ``distributed`` config group, checked."""

    name: str  # none | ddp | fsdp | pipeline
    backend: str  # auto | gloo | nccl
    timeout_s: float
    world_size: int | None  # None: what torchrun started
    split_at: list[int] | None = None  # pipeline: the first module of every stage after the first


def distributed_config(node: DictConfig) -> DistributedConfig:
    """The ``distributed`` group's values, refused with the key to change unless valid."""
    split_at = node.get("split_at")
    if split_at is not None and not isinstance(split_at, (int, str)):
        split_at = list(split_at)  # checked against the model by dpexp.training.pipeline.split_stages
    config = DistributedConfig(str(node.name), str(node.backend), node.timeout_s, node.world_size, split_at)
    if config.name not in MODES:
        raise ConfigError(f"distributed={config.name}: valid choices are {', '.join(MODES)}.")
    if config.backend not in BACKENDS:
        raise ConfigError(f"distributed.backend={config.backend}: valid choices are {', '.join(BACKENDS)}.")
    if not (
        isinstance(config.timeout_s, (int, float))
        and config.timeout_s > 0
        and math.isfinite(config.timeout_s)
    ):
        raise ConfigError(
            f"distributed.timeout_s must be a positive number of seconds, got {config.timeout_s}."
        )
    if config.world_size is not None and not (isinstance(config.world_size, int) and config.world_size >= 1):
        raise ConfigError(f"distributed.world_size must be null or an integer >= 1, got {config.world_size}.")
    if config.name == "pipeline" and config.backend == "nccl":
        raise ConfigError(
            "distributed.backend=nccl: distributed=pipeline passes activations with gloo on the CPU; set "
            "distributed.backend=gloo (or auto)."
        )
    return config


def torchrun_world_size() -> int | None:
    """The number of processes torchrun started (its ``WORLD_SIZE``), None outside torchrun."""
    size = os.environ.get("WORLD_SIZE")
    return None if size is None else int(size)


def start_data_parallel(node: DictConfig | None, device: torch.device) -> DataParallel | None:
    """This process' rank of the data-parallel job that ``distributed`` asks for, None for ``none`` (or no
    ``distributed`` group: a run recorded before it existed ran in one process); refused when the processes
    torchrun started do not match the config."""
    config = None if node is None else distributed_config(node)
    launched = torchrun_world_size()
    if config is None or config.name == "none":
        if launched is not None and launched > 1:
            raise ConfigError(
                f"torchrun started {launched} processes but distributed=none would train {launched} "
                "separate models: add distributed=ddp (or fsdp)."
            )
        return None
    if launched is None or "MASTER_ADDR" not in os.environ:
        raise ConfigError(
            f"distributed={config.name} runs one process per rank under torchrun: "
            + TORCHRUN.format(name=config.name)
        )
    if config.world_size is not None and config.world_size != launched:
        raise ConfigError(
            f"distributed.world_size={config.world_size} but torchrun started {launched} processes: set "
            f"--nproc-per-node (and --nnodes) to match, or distributed.world_size=null."
        )
    if config.name == "pipeline":
        if launched < 2:
            raise ConfigError(
                "distributed=pipeline runs one process per stage and needs at least 2: "
                + TORCHRUN.format(name="pipeline distributed.split_at=[k]")
            )
        if isinstance(config.split_at, list) and len(config.split_at) + 1 != launched:
            raise ConfigError(
                f"distributed.split_at={config.split_at} makes {len(config.split_at) + 1} stages but "
                f"torchrun started {launched} processes (one per stage): give {launched - 1} split points, "
                f"or --nproc-per-node={len(config.split_at) + 1}."
            )
        if device.type != "cpu":
            raise ConfigError(
                f"distributed=pipeline passes activations with gloo on the CPU, the run trains on {device}: "
                "set device=cpu."
            )
    return DataParallel(config, device)


class DataParallel:
    """One rank of a data-parallel job: the process group (``init_process_group`` from torchrun's
    environment), the shares of the logical batch, and the sums of the engine's step
    (:class:`~dpexp.privacy.aggregation.StepAggregation`)."""

    def __init__(self, config: DistributedConfig, device: torch.device) -> None:
        backend = config.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(
                f"distributed.backend=nccl needs CUDA devices, the run trains on {device}: use "
                "distributed.backend=gloo (or auto)."
            )
        self.timeout_s = float(config.timeout_s)
        self.sharded = config.name == "fsdp"  # parameters and optimizer state sharded (FSDP2) between steps
        self.pipelined = config.name == "pipeline"  # a stage of the model per rank (training/pipeline.py)
        self.split_at = config.split_at
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        # the device of the collectives (NCCL communicates CUDA tensors only) and of training
        self.device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
        self.training_device = (
            torch.device("cuda", local) if device.type == "cuda" and device.index is None else device
        )

    @property
    def draws_noise(self) -> bool:
        """Rank 0 draws every step's noise; the other ranks add none."""
        return self.rank == 0

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every tensor replaced in place by its sum over the ranks: one all-reduce per dtype, of the
        tensors flattened into one buffer on the collectives' device."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
            self._collective("summing the step's clipped sums", dist.all_reduce, flat)
            for tensor, piece in zip(group, flat.split([t.numel() for t in group]), strict=True):
                tensor.copy_(piece.view(tensor.shape))

    def share(self, indices: list[int]) -> list[int]:
        """This rank's share ``indices[rank::P]`` of the logical batch (a pipeline stage's: all of it, every
        example runs through every stage), after checking that every rank drew the same batch as rank 0 (else
        examples would be clipped twice or never, or the stages would pass activations of other batches)."""
        mine = torch.tensor(indices, dtype=torch.int64)
        size = torch.tensor([len(indices)], dtype=torch.int64, device=self.device)
        self._collective("agreeing on the logical batch", dist.broadcast, size, 0)
        batch = (
            mine.to(self.device)
            if self.rank == 0
            else torch.empty(int(size), dtype=torch.int64, device=self.device)
        )
        self._collective("agreeing on the logical batch", dist.broadcast, batch, 0)
        if not torch.equal(batch.cpu(), mine):
            raise DistributedError(
                f"rank {self.rank} drew another logical batch than rank 0 ({len(indices)} examples, rank 0 "
                f"{int(size)}): every rank must run the same config (seed, data) on the same data set."
            )
        return list(indices) if self.pipelined else indices[self.rank :: self.world_size]

    def check_same(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse to go on unless ``tensors`` are the same on every rank, as far as their sums and sums of
        squares tell (in float64; one all-reduce of 4 numbers): every rank must step the same model."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for tensor in tensors:
            values = tensor.detach().double()
            total += torch.stack([values.sum(), values.pow(2).sum()]).to(self.device)
        both = torch.cat([total, -total])
        self._collective(f"comparing {what}", dist.all_reduce, both, dist.ReduceOp.MAX)
        if not torch.equal(both[:2], -both[2:]):
            raise DistributedError(
                f"rank {self.rank}: {what} differ across the {self.world_size} ranks (sums from "
                f"{(-both[2:]).tolist()} to {both[:2].tolist()}): the ranks no longer train one model"
            )

    def largest(self, what: str, value: float) -> float:
        """The largest of every rank's ``value`` (one all-reduce of one float64): how the ranks of a sharded
        job agree on what one rank alone knows (a signal received, rank 0's checkpoint clock, a non-finite
        shard)."""
        both = torch.tensor([value], dtype=torch.float64, device=self.device)
        self._collective(what, dist.all_reduce, both, dist.ReduceOp.MAX)
        return float(both)

    def gather(self, what: str, state: Any) -> list[Any] | None:
        """Every rank's ``state`` (picklable: tensors, dicts, lists, numbers) in rank order on rank 0, None on
        the others: a collective every rank runs (a pipeline's checkpoint: every stage holds its own part)."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._collective(what, dist.gather_object, state, gathered, 0)
        return gathered

    def broadcast_object(self, what: str, value: Any) -> Any:
        """Rank 0's ``value`` (picklable) on every rank: a collective every rank runs (the others' ``value``
        is ignored); they wait in it, up to ``distributed.timeout_s``, for as long as rank 0 works on it."""
        box = [value if self.rank == 0 else None]
        self._collective(what, dist.broadcast_object_list, box, 0)
        return box[0]

    def full_state(self, state: Any) -> Any:
        """``state`` (nested dicts and lists) with every sharded tensor (DTensor) gathered whole, on the CPU:
        a collective every rank runs on a state of the same layout (the parameters' and optimizer's)."""
        return self._collective("gathering the sharded state", sharded.full_state, state)

    def broadcast_module(self, module: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank: all ranks start from one model."""
        for tensor in [*module.parameters(), *module.buffers()]:
            buffer = tensor.detach().to(self.device)
            self._collective("broadcasting rank 0's model", dist.broadcast, buffer, 0)
            tensor.detach().copy_(buffer)

    def close(self) -> None:
        """End the process group if this object started it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _collective(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} failed: another rank failed (its own error "
                f"says why) or stalled longer than distributed.timeout_s={self.timeout_s:g} ({first})"
            ) from error
