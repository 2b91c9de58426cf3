"""Per-device clipping on a pipeline (``distributed=pipeline``; He et al. 2023, section 4, Algorithms 2-4).

The model, a sequence of modules, is split into K stages, one process (rank k = stage k) each. Per logical
step of DP-SGD every stage:

1. runs each micro-batch forward: stage 0 on the inputs, stage k > 0 on the activations received from stage
   k - 1 (point-to-point, ``dist.send``/``dist.recv``); it sends its output to stage k + 1;
2. runs it backward through its own privacy engine: the last stage on the per-example losses, stage k < K - 1
   on the per-example surrogate ``l_i = <h_i, g_i>`` with ``h_i`` its output for example i and ``g_i`` the
   output gradient received from stage k + 1, whose parameter gradient is example i's as long as ``g_i`` is
   ``d loss_i / d h_i``, i.e. the later stages do not mix examples. Every stage's engine verifies that of
   its own modules (check 4 of :mod:`dpexp.privacy.verification`, ``check_independence``) and refuses an op
   that mixes examples, a parameter-free or detached one included (``x - x.mean(0)`` or
   ``x - x.mean(0).detach()`` in front of a Linear): that stage fails with a VerificationError on its first
   micro-batch and its neighbours with a :class:`DistributedError`. It sends the gradient of its input back
   to stage k - 1;
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

The trainer (``torchrun ... -m dpexp.train distributed=pipeline distributed.split_at=[k]``) runs a stage
through :class:`PipelineBackend`: every rank builds the whole model (the run's seed, rank 0's parameters),
keeps the modules of its stage (:func:`stage_of`: the model's sequential view,
:func:`dpexp.models.base.sequential_view`) and hands the task :class:`StageModel`, called as the model.
Training (:meth:`PipelineBackend.per_example_loss`): every stage runs its part of the forward through the
task's own call (:meth:`PipelineStage.run`), the last stage the task's loss on the model's output, and it
sends the per-example losses, (b,) values, to every other stage (:meth:`PipelineStage.share_losses`): the
output itself (B x T x V logits for a language model) never leaves the last stage. Evaluation: the forward
runs the whole pipeline (:meth:`PipelineStage.forward`) and the last stage sends the model's output to every
other stage, so that every rank's task computes the same metrics. The trainer's loop, evaluation and record
are the single process' ones. Only the last stage backpropagates its losses; the others backpropagate the
gradient they receive. Rank 0 (stage 0) writes the run record and the checkpoints, every
stage's state gathered to it (:meth:`~dpexp.training.distributed.DataParallel.gather`); what a stage cannot
honour is refused before training (:func:`check_pipeline_config`).

Side inputs (causal LMs, :class:`dpexp.models.sequential.CausalLMSequential`): the stages are
:class:`~dpexp.models.base.Chain` s, whose modules also take the batch's side inputs (the attention mask).
Only the activations cross stages: every rank collates the same micro-batch (``DataParallel.share`` checks
the indices against rank 0's), so every stage passes its own copy of the mask, and builds its blocks' causal
mask from it. The stage's view maps the task's call onto (first input, side inputs) and the last output
back (``Chain.pipeline_inputs``/``pipeline_output``). Generation tasks evaluate on rank 0 alone
(:func:`evaluate_whole`: beam search calls ``generate``, which no stage serves), on a whole copy of the
model that every stage's trainable parameters are gathered into.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpexp.backends import TrainingBackend, check_per_example_loss, method_of
from dpexp.backends.base import LossFunction, refuse_privacy_groups
from dpexp.config import ConfigError
from dpexp.models.base import Chain, sequential_view
from dpexp.privacy import PrivacyEngine, accounting
from dpexp.privacy.grouping import default_thresholds
from dpexp.training.distributed import DataParallel, DistributedError

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # activation dtypes, by header code
MAX_DIMS = 6  # activation dimensions a header describes


def split_stages(model: nn.Sequential, split_at: Sequence[int] | None) -> list[Chain]:
    """The K = len(split_at) + 1 stages of ``model``: stage k holds modules ``split_at[k-1]:split_at[k]``
    (keys kept, so parameter names are the model's), a :class:`~dpexp.models.base.Chain` (of the model's
    class if it is one: its call convention and side inputs); refused unless every stage gets modules with
    trainable parameters, and for a trainable parameter two stages hold (tied): each would step its own
    copy. A frozen one (a tied input embedding / LM head under LoRA) stays the same on both."""
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
    children = list(model.named_children())  # not model[a:b]: a subclass of Sequential may not take a dict
    kind = type(model) if isinstance(model, Chain) else Chain
    stages = [kind(OrderedDict(children[a:b])) for a, b in itertools.pairwise(bounds)]
    owners: dict[int, tuple[int, str]] = {}
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            first = owners.setdefault(id(p), (k, name))
            if first[0] != k and p.requires_grad:
                raise ConfigError(
                    f"distributed.split_at={list(split_at)}: the trainable parameter {first[1]} of stage "
                    f"{first[0]} is {name} of stage {k} (tied weights): each stage would step its own copy; "
                    "untie them (a random LM: +model.config.tie_word_embeddings=false) or train LoRA "
                    "adapters, which freeze them (model=gpt2_lora, or model.lora={rank: 8})."
                )
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
        # the micro-batch between forward and backpropagate: this stage's input, output and input gradient
        self._pending: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None = None

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
        **side: torch.Tensor,
    ) -> torch.Tensor | None:
        """Forward and backward of one micro-batch of ``size`` examples through this stage: ``inputs`` on the
        first stage, ``loss_fn`` (output -> per-example losses, shape (size,)) on the last; returns the
        losses there, None elsewhere. Dim 0 of every activation is the batch: refused unless it is
        ``size``. ``side``: the micro-batch's side inputs (an attention mask), which every stage is given
        itself (every rank holds the batch) and passes to its modules. (The trainer's protocol is
        :meth:`run`, :meth:`share_losses` then :meth:`backpropagate`.)"""
        if (inputs is None) == self.first or (loss_fn is None) == self.last:
            raise ValueError(
                f"stage {self.stage}: the first stage takes inputs, the last loss_fn, no other stage either"
            )
        out = self._forward_stage(size, inputs, side)
        losses = loss_fn(out) if self.last else None
        self.backpropagate(losses)
        return losses.detach() if self.last else None

    def forward(self, size: int, inputs: torch.Tensor | None = None, **side: torch.Tensor) -> torch.Tensor:
        """The model's output for one micro-batch of ``size`` examples, on every stage: stage 0 runs
        ``inputs`` (the other stages take none), every stage its own modules on what the stage before sent,
        and the last stage sends its output to every other stage (the last stage's output keeps its graph;
        elsewhere it is a received copy); ``side``: as in :meth:`backward`. With gradients enabled
        (training) :meth:`backpropagate` must follow before the next forward."""
        if (inputs is None) == self.first:
            raise ValueError(f"stage {self.stage}: the first stage takes the inputs, no other stage does")
        out = self._forward_stage(size, inputs, side)
        if self.last:
            for peer in range(self.num_stages - 1):
                self._send_activation(out.detach(), peer, "sending the model's output")
            return out
        return self._receive_activation(size, self.num_stages - 1, "receiving the model's output")

    def run(self, size: int, inputs: torch.Tensor | None = None, **side: torch.Tensor) -> torch.Tensor | None:
        """This stage's part of the model's forward for one micro-batch of ``size`` examples (the trainer's
        training forward): ``inputs`` on stage 0; returns the model's output on the last stage, None on the
        others, which get the per-example losses from :meth:`share_losses` instead of the output (B x T x V
        logits for a language model); ``side``: as in :meth:`backward`. :meth:`backpropagate` follows."""
        if (inputs is None) == self.first:
            raise ValueError(f"stage {self.stage}: the first stage takes the inputs, no other stage does")
        out = self._forward_stage(size, inputs, side)
        return out if self.last else None

    def share_losses(self, losses: torch.Tensor | None, size: int) -> torch.Tensor:
        """The micro-batch's per-example losses (``size``,) on every stage: the last stage's ``losses`` sent
        (detached) to every other stage, which passes None and receives them."""
        if (losses is None) == self.last:
            raise ValueError(f"stage {self.stage}: the last stage gives the losses, no other stage does")
        if self.last:
            for peer in range(self.num_stages - 1):
                self._send_activation(losses.detach(), peer, "sending the per-example losses")
            return losses
        return self._receive_activation(size, self.num_stages - 1, "receiving the per-example losses")

    def backpropagate(self, losses: torch.Tensor | None = None) -> None:
        """Backward of the micro-batch of the last :meth:`forward` through this stage's engine: on the last
        stage its per-example ``losses`` (shape (size,)); on the others (``losses`` None) the surrogate
        ``<h_i, g_i>`` of the output gradient received from the next stage. Sends the gradient of its input
        to the stage before."""
        if self._pending is None:
            raise RuntimeError(
                f"stage {self.stage}: backpropagate() without a forward with gradients enabled before it"
            )
        x, out, received = self._pending
        self._pending = None
        if self.last:
            if losses is None:
                raise ValueError(f"stage {self.stage}: the last stage backpropagates the per-example losses")
        else:
            if losses is not None:
                raise ValueError(f"stage {self.stage}: only the last stage takes the losses")
            grad = self._receive(out.shape, out.dtype, self.stage + 1, "receiving its output gradient")
            losses = (out * grad).flatten(1).sum(1)  # per-example: d/dtheta <h_i, g_i> = J_i^T g_i
        self.engine.backward(losses)
        if not self.first:  # every pass forms the same gradient; none reached x: it is zero
            grad_x = received[-1].detach() if received else torch.zeros_like(x)
            self._send(grad_x, self.stage - 1, "sending its input gradient")

    def _forward_stage(
        self, size: int, inputs: torch.Tensor | None, side: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """This stage's output on ``inputs`` (stage 0) or on the activation received from the stage before,
        sent on to the next stage; with gradients enabled, kept with its input for :meth:`backpropagate`."""
        x = inputs if self.first else self._receive_activation(size, self.stage - 1, "receiving its input")
        track = torch.is_grad_enabled()
        received: list[torch.Tensor] = []
        if track:
            if self._pending is not None:
                raise RuntimeError(
                    f"stage {self.stage}: a second forward before the backward of the first; on a pipeline "
                    "the model is called once per micro-batch (a task whose loss calls the model twice "
                    "cannot run on one)"
                )
            if not self.first:
                x.requires_grad_(True)
                x.register_hook(received.append)
        for name, tensor in side.items():
            self._check_batch(tensor, size, f"side input {name}")
        out = self.module(x, **side)
        self._check_batch(out, size, "its output")
        if not self.last:
            self._send_activation(out.detach(), self.stage + 1, "sending its output")
        if track:
            self._pending = (x, out, received)
        return out

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

    def all_thresholds(self) -> list[float]:
        """Every stage's threshold C_k, in stage order (an all-gather every stage runs)."""
        mine = self.engine.thresholds.detach().to(torch.float64).reshape(1)
        every = [torch.empty_like(mine) for _ in range(self.num_stages)]
        try:
            dist.all_gather(every, mine)
        except RuntimeError as error:
            raise DistributedError(
                f"stage {self.stage} of {self.num_stages}: gathering the stages' thresholds failed: another "
                f"stage failed (its own error says why) or stalled longer than "
                f"distributed.timeout_s={self.timeout_s:g} ({_first_line(error)})"
            ) from error
        return [float(t) for t in every]

    def close(self) -> None:
        """Remove the engine's hooks; end the process group if this stage started it."""
        self.engine.detach()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ point to point
    def _receive_activation(self, size: int, peer: int, what: str) -> torch.Tensor:
        """An activation from ``peer``: its header (dims, dtype, shape), then the tensor."""
        header = self._receive((MAX_DIMS + 2,), torch.int64, peer, f"{what} (shape)")
        ndim, code = int(header[0]), int(header[1])
        x = self._receive(tuple(header[2 : 2 + ndim].tolist()), DTYPES[code], peer, what)
        self._check_batch(x, size, f"the tensor from stage {peer}")
        return x

    def _send_activation(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        """An activation to ``peer`` with its header (a gradient needs none: it has its output's shape)."""
        if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
            raise ValueError(
                f"stage {self.stage}: an activation of {tensor.dim()} dims, {tensor.dtype}; a pipeline "
                f"passes at most {MAX_DIMS} dims of {', '.join(map(str, DTYPES))}"
            )
        header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        self._p2p(f"{what} (shape)", dist.send, header, peer)
        self._send(tensor, peer, what)

    def _send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
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
            raise DistributedError(
                f"stage {self.stage} of {self.num_stages}: {what} with stage {peer} failed: that stage "
                f"failed (its own error says why) or stalled longer than "
                f"distributed.timeout_s={self.timeout_s:g} "
                f"({_first_line(error)})"
            ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---------------------------------------------------------------------------------------------- the trainer
def check_pipeline_config(cfg: DictConfig, num_stages: int) -> None:
    """Refuse, before any data loads, what a stage cannot honour (``cfg``: the run's config), naming the key
    and the fix: every stage clips its own parameters with the dpexp engine as one group of group-wise
    clipping with equal budgets, and steps its own optimizer on nothing but its own coordinates."""
    clip = cfg.clip
    method = method_of(clip)
    if method != "dpexp":
        raise ConfigError(
            f"clip={clip.name} (clip.method={method}) runs in one process: under distributed=pipeline every "
            f"stage clips its own parameters with the dpexp engine; use clip=groupwise "
            f"(clip.engine.groups={num_stages})."
        )
    engine = clip.engine
    if engine.clipping == "flat":
        raise ConfigError(
            f"clip={clip.name} (clip.engine.clipping=flat) needs every example's gradient norm over all "
            "stages, which no stage has: use clip=groupwise (a threshold per stage), or distributed=ddp for "
            "flat clipping."
        )
    if engine.clipping != "groups":
        raise ConfigError(
            f"clip.engine.clipping={engine.clipping}: under distributed=pipeline every stage is one clipping "
            f"group; use clip=groupwise with clip.engine.groups={num_stages}."
        )
    if engine.groups is not None and engine.groups != num_stages:
        raise ConfigError(
            f"clip.engine.groups={engine.groups}: under distributed=pipeline the groups are the "
            f"{num_stages} stages (distributed.split_at); set clip.engine.groups={num_stages} (or null)."
        )
    if engine.get("coordinate") is not None:
        raise ConfigError(
            "clip.engine.coordinate (coordinate-wise clipping) is not run on a pipeline; set "
            "clip.engine.coordinate=null, or use distributed=ddp."
        )
    stage_engine_kwargs(engine, 0, num_stages)  # noise allocation, rescaling, thresholds
    if cfg.optim.name == "adadp":
        raise ConfigError(
            "optim=adadp accepts or discards a step by an error over all parameters, which no stage has: "
            "use optim=sgd (or adam, adamw) under distributed=pipeline, or distributed=ddp."
        )
    if str(cfg.privacy.individual.variant) != "none":
        raise ConfigError(
            "privacy.individual is not run on a pipeline: set privacy.individual.variant=none, or use "
            "distributed=none or ddp."
        )


def stage_of(model: nn.Module, parallel: DataParallel) -> nn.Sequential:
    """This rank's stage of ``model``: the modules ``split_at`` gives it of the model's sequential view
    (its parameters are the model's); refused for a model without one."""
    view = sequential_view(model)
    if view is None:
        raise ConfigError(
            f"distributed=pipeline splits a sequence of modules and {type(model).__name__} has no sequential "
            "view (dpexp.models.base.sequential_view): use model=small_cnn, wrn16_4, a GPT-2 (gpt2_tiny, "
            "gpt2_lora, ...) or a Llama / Qwen2 (llama_tiny, smollm2_135m, ...), or distributed=ddp."
        )
    return split_stages(view, parallel.split_at)[parallel.rank]


class StageModel(nn.Module):
    """The model as the task sees it on this stage: the stage's modules (with the model's names, so its
    parameters and ``state_dict`` are this stage's part of the model's), called as the model is; its forward
    runs the whole pipeline and returns the model's output on every stage (:meth:`PipelineStage.forward`),
    or, with ``stage_only`` (the trainer's training forward, :meth:`PipelineBackend.per_example_loss`), this
    stage's part: the output on the last stage, :class:`StageDone` raised on the others. Tasks call the model
    once per batch. The stage's view maps the call (``Chain.pipeline_inputs``): one
    batch-first tensor (image models), or a causal LM's ``input_ids=..., attention_mask=...`` (the mask is a
    side input every stage takes from its own copy of the batch), and the output back (LMs: ``.logits``)."""

    def __init__(self, stage: PipelineStage) -> None:
        super().__init__()
        for name, child in stage.module.named_children():
            self.add_module(name, child)
        self.pipeline = stage  # not a module: the engine's root stays stage.module
        self.stage_only = False  # the trainer's training forward: this stage's part (PipelineBackend)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stage = self.pipeline
        view = stage.module if isinstance(stage.module, Chain) else Chain
        inputs, side = view.pipeline_inputs(*args, **kwargs)
        size, first_inputs = inputs.shape[0], inputs if stage.first else None
        if not self.stage_only:
            return view.pipeline_output(stage.forward(size, first_inputs, **side))
        out = stage.run(size, first_inputs, **side)
        if out is None:  # not the last stage: nothing for the task to compute a loss from
            raise StageDone(size)
        return view.pipeline_output(out)


class StageDone(BaseException):  # BaseException: a task's `except Exception` does not catch it
    """Raised by a :class:`StageModel` other than the last in its training forward, once its part of the
    forward is done: the task's loss needs the model's output, which only the last stage has."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size

    def train(self, mode: bool = True) -> StageModel:
        super().train(mode)
        self.pipeline.module.train(mode)
        return self


class PipelineBackend(TrainingBackend):
    """One stage of a pipeline behind the trainer's backend interface: ``model`` is the :class:`StageModel`
    of the stage; :meth:`backward` backpropagates the micro-batch of its last forward (the losses on the
    last stage, the received output gradient elsewhere); :meth:`step` is the stage's private step."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.model = StageModel(stage)
        self.optimizer = stage.optimizer

    def per_example_loss(self, loss_fn: LossFunction, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The task's per-example losses of the micro-batch on every stage: every stage runs its part of the
        forward (the task's call, :class:`StageModel`), the last stage the task's loss on the output, and
        sends the (b,) losses to the others; the model's output never leaves the last stage."""
        self.model.stage_only = True
        try:
            losses = loss_fn(self.model, batch)
        except StageDone as done:
            return self.stage.share_losses(None, done.size)
        finally:
            self.model.stage_only = False
        check_per_example_loss(losses)
        return self.stage.share_losses(losses, losses.shape[0])

    def backward(self, per_example_loss: torch.Tensor, privacy_groups: torch.Tensor | None = None) -> None:
        refuse_privacy_groups("pipeline", privacy_groups)
        check_per_example_loss(per_example_loss)
        self.stage.backpropagate(per_example_loss if self.stage.last else None)

    def step(self) -> None:
        self.stage.step()

    def close(self) -> None:
        self.stage.close()  # the trainer's process group stays (DataParallel owns it)

    def released(self) -> dict[str, Any]:
        """Adaptive thresholds of every stage, ``{"thresholds": {"k stage k": C_k}}`` (each moved by noised
        counts only); a collective, every stage calls it (at every evaluation)."""
        if self.stage.engine.adaptive is None:
            return {}
        values = self.stage.all_thresholds()
        return {"thresholds": {f"{k} stage {k}": value for k, value in enumerate(values)}}

    def state_dict(self) -> dict[str, Any]:
        return self.stage.engine.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stage.engine.load_state_dict(state)


def evaluate_whole(
    task: Any, model: StageModel, whole: nn.Module | None, parallel: DataParallel, batch_size: int
) -> dict[str, float]:
    """The task's evaluation of the model trained so far, on rank 0 and the whole model ``whole`` (rank 0's
    copy, kept before the model was split; None on the other ranks): for the generation tasks, whose beam
    search calls ``generate`` (a cache, many short forwards), which no stage serves. Every stage's trainable
    parameters (LoRA: the adapters) go to rank 0 (a gather, as a checkpoint's) into ``whole``'s sequential
    view (the view's names are the stages'); the frozen ones are the same there already (rank 0's, never
    stepped). The other ranks wait for rank 0's metrics, which every rank returns."""
    stepped = {id(p) for group in model.pipeline.optimizer.param_groups for p in group["params"]}
    # (not requires_grad: the engine turns it off between its backward passes)
    mine = {name: p.detach().cpu() for name, p in model.named_parameters() if id(p) in stepped}
    stages = parallel.gather("gathering the stages' parameters for evaluation", mine)
    metrics = None
    if stages is not None:
        view = sequential_view(whole)
        trained = {name: value for stage in stages for name, value in stage.items()}
        wanted = {name for name, p in view.named_parameters() if p.requires_grad}
        if set(trained) != wanted:
            raise RuntimeError(
                f"the stages' trainable parameters {sorted(set(trained) ^ wanted)} are not the whole "
                "model's (or the other way round)"
            )
        with torch.no_grad():
            for name, p in view.named_parameters():
                if name in trained:
                    p.copy_(trained[name])
        whole.eval()
        metrics = task.evaluate(whole, batch_size)
    return parallel.broadcast_object("waiting for rank 0's evaluation of the whole model", metrics)


def build_pipeline_backend(
    clip_cfg: Any,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    sample_size: int,
    noise_multiplier: float | Sequence[float],
    seed: int,
    timeout_s: float,
) -> PipelineBackend:
    """The backend of this rank's stage ``module`` (:func:`stage_of`), its ``optimizer`` over the stage's
    parameters, from the run's ``clip`` config (:func:`check_pipeline_config` passed) and plan (B, N,
    sigma: the job's, each stage scales it by sqrt(K))."""
    if isinstance(clip_cfg, DictConfig):
        clip_cfg = OmegaConf.to_container(clip_cfg, resolve=True)
    stage = PipelineStage(
        module,
        optimizer,
        batch_size=batch_size,
        sample_size=sample_size,
        max_grad_norm=float(clip_cfg["max_grad_norm"]),
        noise_multiplier=noise_multiplier,
        engine_kwargs=clip_cfg["engine"],
        seed=seed,
        timeout_s=timeout_s,
    )
    return PipelineBackend(stage)
