"""Per-device clipping on a pipeline (``distributed=pipeline``; He et al. 2023, section 4, Algorithms 2-4).

The model, a sequence of modules, is split into K stages, one process (rank k = stage k) each. Per logical
step of DP-SGD every stage:

1. runs each micro-batch forward: stage 0 on the inputs, stage k > 0 on the activations received from stage
   k - 1 (point-to-point, ``dist.send``/``dist.recv``); it sends its output to stage k + 1;
2. runs it backward through its own privacy engine: the last stage on the per-example losses, stage k < K - 1
   on the per-example surrogate ``l_i = <h_i, g_i>`` with ``h_i`` its output for example i and ``g_i`` the
   output gradient received from stage k + 1, whose parameter gradient is example i's as long as ``g_i`` is
   ``d loss_i / d h_i``, i.e. the later stages do not mix examples (the single-process engine's assumption
   too; note that the engine accepts a parameter-free batch-mixing op such as ``x - x.mean(0)`` in front of
   a Linear, in one process as on a stage); it sends the gradient of its input back to stage k - 1;
3. clips each example's gradient of its own parameters to its own threshold C_k (fixed or adaptive: the
   stage is one group of He et al.'s group-wise clipping, Algorithm 1 with groups = stages), adds its own
   noise and steps its own optimizer. No per-example norm, threshold or count crosses stages.

Noise, equal budget (He et al. section 3.3, the allocation of their GPT-3 runs): group-wise clipping with K
groups gives group k the std ``sigma S gamma_k = sigma sqrt(K) C_k`` (``gamma_k = C_k``; sigma_new of
Prop. 3.1 with adaptive thresholds). A stage's engine sees one group, so it is built with the noise
multiplier ``sigma_k = sigma sqrt(K)`` (:func:`stage_noise_multiplier`): its std is then ``sigma_k C_k``,
its clip counts' ``sigma_b = sigma_k s sqrt(1 / r) = sigma s sqrt(K / r)`` and its
``sigma_new = sigma_k / sqrt(1 - r)``, each exactly the single-process group-wise value. The K stages
release Gaussian mechanisms on disjoint coordinates (each of sensitivity C_k), which compose into one of
``1 / sigma^2 = sum_k 1 / sigma_k^2`` (He et al. appendix D): the job is accounted with sigma
(:meth:`PipelineStage.get_epsilon`), as single-process group-wise clipping. Each stage draws its noise once
per step from its own generator (:func:`stage_generator`: independent across stages).

Not ``torch.distributed.pipelining``: it runs on CPU with gloo (torch 2.14, ``PipelineStage`` +
``ScheduleGPipe`` on a two-stage MLP), but its schedule calls ``torch.autograd.backward`` on a scalar loss
itself, which the engine refuses ("gradients of a model under a PrivacyEngine must be computed with
engine.backward(per_example_loss), not loss.backward()"): per-example clipping needs the per-example losses.

A stage that fails ends the job instead of hanging it: its neighbours' next send or receive fails when its
connection closes, or at the latest after ``distributed.timeout_s``, with a :class:`DistributedError`.
Micro-batches run one after another (forward and backward of micro-batch m on every stage before m + 1),
without GPipe's overlap: the schedule changes the speed, not the released values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dpexp.config import ConfigError
from dpexp.privacy import PrivacyEngine, accounting
from dpexp.privacy.grouping import default_thresholds
from dpexp.training.distributed import DistributedError

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # activation dtypes, by header code
MAX_DIMS = 6  # activation dimensions a header describes


def split_stages(model: nn.Sequential, split_at: Sequence[int] | None) -> list[nn.Sequential]:
    """The K = len(split_at) + 1 stages of ``model``: stage k holds modules ``split_at[k-1]:split_at[k]``
    (keys kept, so parameter names are the model's); refused unless every stage gets modules with trainable
    parameters."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"distributed=pipeline splits an nn.Sequential, got {type(model).__name__}.")
    n = len(model)
    if (
        split_at is None
        or len(split_at) == 0
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in split_at)
        or list(split_at) != sorted(set(split_at))
        or not 0 < split_at[0] <= split_at[-1] < n
    ):
        raise ConfigError(
            f"distributed.split_at={None if split_at is None else list(split_at)}: give the index of the "
            f"first module of every stage after the first, strictly increasing in 1..{n - 1} "
            f"(e.g. [{n // 2}])."
        )
    bounds = [0, *split_at, n]
    stages = [model[a:b] for a, b in itertools.pairwise(bounds)]
    for k, stage in enumerate(stages):
        if not any(p.requires_grad for p in stage.parameters()):
            raise ConfigError(
                f"distributed.split_at={list(split_at)}: stage {k} (modules {bounds[k]}.."
                f"{bounds[k + 1] - 1}) has no trainable parameters; move a split point."
            )
    return stages


def stage_noise_multiplier(noise_multiplier: float | Sequence[float], num_stages: int) -> Any:
    """``sigma_k = sigma sqrt(K)`` (every step's, for a schedule): a stage's noise multiplier relative to its
    own threshold, the equal-budget allocation of K groups (module docstring)."""
    scale = math.sqrt(num_stages)
    if isinstance(noise_multiplier, (int, float)):
        return float(noise_multiplier) * scale
    return [float(sigma) * scale for sigma in noise_multiplier]


def stage_generator(seed: int, stage: int) -> torch.Generator:
    """Stage ``stage``'s noise generator, seeded from (seed, stage): stages never share a noise stream (equal
    noise on two stages' coordinates would release their difference without noise)."""
    state = np.random.SeedSequence([seed, stage]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def stage_engine_kwargs(engine_kwargs: Mapping[str, Any], stage: int, num_stages: int) -> dict[str, Any]:
    """The stage's engine arguments from the job's (``clip.engine``): one group, the stage's threshold;
    refused where the job's would need another stage's state."""
    kwargs = dict(engine_kwargs)
    allocation = kwargs.get("noise_allocation", "global")
    if allocation != "equal_budget":
        raise ConfigError(
            f"clip.engine.noise_allocation={allocation}: per-device clipping gives every stage its own "
            "noise, which is the equal-budget allocation (He et al. sec. 3.3): set "
            "clip.engine.noise_allocation=equal_budget."
        )
    adaptive = kwargs.get("adaptive")
    rescale = (
        adaptive.get("rescale_to_global", False)
        if isinstance(adaptive, Mapping)
        else getattr(adaptive, "rescale_to_global", False)  # an AdaptiveConfig, or None
    )
    if rescale:
        raise ConfigError(
            "clip.engine.adaptive.rescale_to_global=true needs every stage's threshold on every stage: set "
            "it to false under distributed=pipeline."
        )
    thresholds = kwargs.get("thresholds")
    if thresholds is not None and len(thresholds) != num_stages:
        raise ConfigError(
            f"clip.engine.thresholds has {len(thresholds)} values for {num_stages} pipeline stages: give one "
            "per stage, or null (C / sqrt(K) each)."
        )
    kwargs.update(clipping="flat", groups=None)
    kwargs["thresholds"] = None if thresholds is None else [float(thresholds[stage])]
    return kwargs


class PipelineStage:
    """Stage ``rank`` of a K-stage pipeline: its module, its engine (its parameters, threshold and noise) and
    its links to the stages before and after it. The process group comes from torchrun's environment."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        batch_size: int,
        sample_size: int,
        max_grad_norm: float,
        noise_multiplier: float | Sequence[float],
        engine_kwargs: Mapping[str, Any],
        seed: int,
        timeout_s: float = 600.0,
        backend: str = "gloo",
    ) -> None:
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        self.stage, self.num_stages = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        if self.num_stages < 2:
            raise ConfigError(
                "distributed=pipeline needs at least 2 stages (torchrun --nproc-per-node >= 2)."
            )
        kwargs = stage_engine_kwargs(engine_kwargs, self.stage, self.num_stages)
        if kwargs["thresholds"] is None:
            kwargs["thresholds"] = [default_thresholds(max_grad_norm, self.num_stages)[self.stage]]
        self.noise_multiplier = noise_multiplier
        self.module = module
        self.engine = PrivacyEngine(
            module,
            batch_size=batch_size,
            sample_size=sample_size,
            max_grad_norm=max_grad_norm,
            noise_multiplier=stage_noise_multiplier(noise_multiplier, self.num_stages),
            generator=None if kwargs.get("secure_mode") else stage_generator(seed, self.stage),
            **kwargs,
        )
        self.optimizer = self.engine.attach(optimizer)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def backward(
        self,
        size: int,
        inputs: torch.Tensor | None = None,
        loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one micro-batch of ``size`` examples through this stage: ``inputs`` on the
        first stage, ``loss_fn`` (output -> per-example losses, shape (size,)) on the last; returns the
        losses there, None elsewhere. Dim 0 of every activation is the batch: refused unless it is
        ``size``."""
        if (inputs is None) == self.first or (loss_fn is None) == self.last:
            raise ValueError(
                f"stage {self.stage}: the first stage takes inputs, the last loss_fn, no other stage either"
            )
        x = inputs if self.first else self._receive_activation(size)
        received: list[torch.Tensor] = []
        if not self.first:
            x.requires_grad_(True)
            x.register_hook(lambda grad: received.append(grad))  # every pass forms the same; keep the last
        out = self.module(x)
        self._check_batch(out, size, "its output")
        if self.last:
            losses = loss_fn(out)
        else:
            self._send(out.detach(), self.stage + 1, "sending its output")
            grad = self._receive(out.shape, out.dtype, self.stage + 1, "receiving its output gradient")
            losses = (out * grad).flatten(1).sum(1)  # per-example: d/dtheta <h_i, g_i> = J_i^T g_i
        self.engine.backward(losses)
        if not self.first:
            self._send(received[-1].detach(), self.stage - 1, "sending its input gradient")
        return losses.detach() if self.last else None

    def step(self) -> None:
        """The stage's private step: its noise, / B, its optimizer (``engine.attach``)."""
        self.optimizer.step()
        self.optimizer.zero_grad()

    def get_epsilon(self, delta: float, accountant: str | None = None) -> float:
        """The job's epsilon: the K stages' releases compose to the Gaussian mechanism of sigma (module
        docstring), accounted as single-process group-wise clipping after the same steps."""
        steps = self.engine.steps
        if steps == 0:
            return 0.0
        scheduled = not isinstance(self.noise_multiplier, (int, float))
        sigmas = list(self.noise_multiplier[:steps]) if scheduled else [float(self.noise_multiplier)]
        return accounting.get_schedule_epsilon(
            sigmas,
            self.engine.sample_rate,
            delta,
            accountant or self.engine.accountant,
            repeat=1 if scheduled else steps,
        )

    def close(self) -> None:
        """Remove the engine's hooks; end the process group if this stage started it."""
        self.engine.detach()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ point to point
    def _receive_activation(self, size: int) -> torch.Tensor:
        header = self._receive((MAX_DIMS + 2,), torch.int64, self.stage - 1, "receiving its input's shape")
        ndim, code = int(header[0]), int(header[1])
        x = self._receive(
            tuple(header[2 : 2 + ndim].tolist()), DTYPES[code], self.stage - 1, "receiving input"
        )
        self._check_batch(x, size, f"the input from stage {self.stage - 1}")
        return x

    def _send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        if peer > self.stage:  # activations go with their shape; gradients have their output's
            if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
                raise ValueError(
                    f"stage {self.stage}: an activation of {tensor.dim()} dims, {tensor.dtype}; a pipeline "
                    f"passes at most {MAX_DIMS} dims of {', '.join(map(str, DTYPES))}"
                )
            header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
            header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
            self._p2p(f"{what} (shape)", dist.send, header, peer)
        self._p2p(what, dist.send, tensor.contiguous(), peer)

    def _receive(self, shape: Sequence[int], dtype: torch.dtype, peer: int, what: str) -> torch.Tensor:
        tensor = torch.empty(tuple(shape), dtype=dtype)
        self._p2p(what, dist.recv, tensor, peer)
        return tensor

    def _check_batch(self, tensor: torch.Tensor, size: int, what: str) -> None:
        if tensor.dim() == 0 or tensor.shape[0] != size:
            raise DistributedError(
                f"stage {self.stage}: {what} has shape {tuple(tensor.shape)}, but the micro-batch has {size} "
                "examples: a pipeline stage must keep the batch in dim 0 (the stages disagree on the batch)."
            )

    def _p2p(self, what: str, call: Callable[..., Any], tensor: torch.Tensor, peer: int) -> None:
        try:
            call(tensor, peer)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DistributedError(
                f"stage {self.stage} of {self.num_stages}: {what} with stage {peer} failed: that stage "
                f"failed (its own error says why) or stalled longer than "
                f"distributed.timeout_s={self.timeout_s:g} "
                f"({first})"
            ) from error
