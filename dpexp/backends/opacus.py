"""The Opacus 1.6 baseline behind dpexp's :class:`~dpexp.backends.base.TrainingBackend` interface.

Built directly from Opacus' parts (not ``opacus.PrivacyEngine``, which owns data loading and accounting):

- hooks mode: ``GradSampleModule`` instantiates per-example gradients g_i; ``DPOptimizer`` (flat: g_i scaled
  by min(1, C/||g_i||)) or ``DPPerLayerOptimizer`` (each of the P parameter tensors clipped to C/sqrt(P)).
- ghost mode: ``GradSampleModuleFastGradientClipping`` computes ||g_i|| by the ghost norm trick and a second
  backward pass on the reweighted loss sum_i c_i l_i gives sum_i clip(g_i) (Li et al. 2022, sec. 4).

Micro-batch accumulation uses Opacus' skip-step protocol (as its ``BatchMemoryManager`` does): when the next
micro-batch arrives, the pending one is clipped and added to ``p.summed_grad`` by a skipped step; only
:meth:`OpacusBackend.step` runs a real step, which adds N(0, sigma^2 C^2) noise once and divides by the
expected batch size B.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping, DPPerLayerOptimizer
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from opacus.validators import ModuleValidator
from torch import nn

from dpexp.backends.base import TrainingBackend, check_per_example_loss, refuse_privacy_groups
from dpexp.privacy.broadcast import BroadcastExpander
from dpexp.privacy.state import StateWatch

GRAD_SAMPLE_MODES = ("hooks", "ghost")
# Opacus' full backward hooks warn when the model input needs no gradient (e.g. images); harmless here.
_INPUT_GRAD_WARNING = (
    "Full backward hook is firing when gradients are computed with respect to module outputs"
)
CLIPPINGS = ("flat", "per_layer")


class OpacusBackend(TrainingBackend):
    """Opacus clipping and noise with noise added once per logical step.

    ``model`` must be in training mode and free of modules that mix examples (BatchNorm): Opacus' validator
    raises otherwise. A module that changes a buffer in a training forward is refused at that forward, and
    one that finds a tensor attribute an earlier training forward wrote at its call
    (:class:`dpexp.privacy.state.StateWatch`). ``optimizer`` must hold exactly the model's trainable
    parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        batch_size: int,
        max_grad_norm: float,
        noise_multiplier: float,
        grad_sample_mode: str = "hooks",
        clipping: str = "flat",
    ) -> None:
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(
                f"Unknown opacus grad_sample_mode {grad_sample_mode!r}; "
                f"valid: {', '.join(GRAD_SAMPLE_MODES)}."
            )
        if clipping not in CLIPPINGS:
            raise ValueError(f"Unknown opacus clipping {clipping!r}; valid: {', '.join(CLIPPINGS)}.")
        if grad_sample_mode == "ghost" and clipping != "flat":
            raise ValueError(
                "Opacus fast gradient (ghost) clipping supports flat clipping only; use hooks mode."
            )
        model.train()
        ModuleValidator.validate(model, strict=True)
        # the engine's rule for state carried across batches: no buffer changed in a training forward, no
        # tensor attribute a training forward wrote read by a later call (no replay here to clear it)
        self._state = StateWatch(model, ignored=frozenset({"activations"}))  # Opacus' own, per layer
        self._state_hooks = self._state.hooks()
        # position ids of batch size 1 would give Opacus batch-summed gradients (dpexp.privacy.broadcast)
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        self._expander = BroadcastExpander(model, embeddings)
        self.ghost = grad_sample_mode == "ghost"
        common = {
            "noise_multiplier": noise_multiplier,
            "expected_batch_size": batch_size,
            "loss_reduction": "mean",
        }
        if self.ghost:
            self.model = GradSampleModuleFastGradientClipping(
                model,
                batch_first=True,
                loss_reduction="sum",
                max_grad_norm=max_grad_norm,
                use_ghost_clipping=True,
            )
            self.optimizer = DPOptimizerFastGradientClipping(optimizer, max_grad_norm=max_grad_norm, **common)
        else:
            self.model = GradSampleModule(model, batch_first=True, loss_reduction="sum")
            if clipping == "flat":
                self.optimizer = DPOptimizer(optimizer, max_grad_norm=max_grad_norm, **common)
            else:
                num_tensors = len(self._params(optimizer))
                thresholds = [max_grad_norm / math.sqrt(num_tensors)] * num_tensors
                self.optimizer = DPPerLayerOptimizer(optimizer, max_grad_norm=thresholds, **common)
        self._pending = False  # a micro-batch has been backpropagated but not yet clipped into summed_grad

    @staticmethod
    def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

    def backward(self, per_example_loss: torch.Tensor, privacy_groups: torch.Tensor | None = None) -> None:
        check_per_example_loss(per_example_loss)
        refuse_privacy_groups("opacus", privacy_groups)
        if self._pending:  # clip and accumulate the previous micro-batch without noise or update
            self.optimizer.signal_skip_step(do_skip=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_INPUT_GRAD_WARNING)
            self._backward(per_example_loss)
        self._pending = True

    def _backward(self, per_example_loss: torch.Tensor) -> None:
        if self.ghost:
            DPTensorFastGradientClipping(
                self.model, self.optimizer, per_example_loss, loss_reduction="sum"
            ).backward()
        else:
            per_example_loss.sum().backward()

    def step(self) -> None:
        if not self._pending:  # empty logical batch: the update is pure noise / B
            for p in self.optimizer.params:
                if self.ghost:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = False

    def close(self) -> None:
        for handle in self._state_hooks:
            handle.remove()
        self._state.remove()
        self._expander.remove()
        self.model.to_standard_module()


def build(
    clip_cfg: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    sample_size: int,
    noise_multiplier: float,
) -> OpacusBackend:
    return OpacusBackend(
        model,
        optimizer,
        batch_size=batch_size,
        max_grad_norm=float(clip_cfg["max_grad_norm"]),
        noise_multiplier=noise_multiplier,
        grad_sample_mode=clip_cfg["opacus"]["grad_sample_mode"],
        clipping=clip_cfg["opacus"]["clipping"],
    )
