"""The privacy engine: per-example clipping of parameter groups, noise, thresholds and accounting.

Life of one logical step (B = expected batch size, the same for every step)::

    engine = PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=C, noise_multiplier=sigma)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=lr))
    for micro_batch in logical_batch:           # forward hooks book-keep each layer's input
        engine.backward(per_example_loss)       # output-gradient hooks clip and sum, group by group
    optimizer.step()                            # noise once, / B, inner step, adapt thresholds, account
    optimizer.zero_grad()

Backends (how the clipped sum ``sum_i c_i g_i`` is obtained):

* ``bk``: book-keeping (Bu et al. 2023, Algorithm 1). One backward pass; a group is clipped and summed as
  soon as backpropagation has delivered every layer of it (He et al. 2023, section 3.1: per-layer clipping
  is fused into backpropagation and each layer's tensors are freed right away; a flat group completes at
  the input layer). Parameter gradients are never computed by autograd ("ghost differentiation"): the
  engine turns ``requires_grad`` off on the parameters it handles and forms ``a^T diag(c) g`` itself.
* ``ghost``: ghost clipping (Li et al. 2022, section 4): a first backward computes only norms, a second
  one the clipped sums with the now known factors; nothing is held across the first backward.
* ``instantiate``: per-example gradients are materialised (the Opacus way), for reference.

Norms use the ghost norm or instantiation per layer by cost (``norm_mode="auto"``, BK-MixOpt: the ghost
norm's ``T^2 (L + R)`` against instantiation's ``T L R``, with a memory cap). Instantiated per-example
gradients are kept, so that the clipped sum is ``tensordot(c, g)`` instead of a second matmul over T:

* in fused per-layer clipping, for linear layers whose per-example gradients hold at most 4x the values of
  the layer's activation and output gradient (a transient: one layer at a time);
* in flat clipping, for single-use untied layers whose per-example gradients are smaller than those factors,
  or (linear layers) larger by at most what is left of a budget of one parameter-sized tensor per backward
  pass: they wait for the input layer, so the budget bounds the memory they add.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpexp.privacy import accounting
from dpexp.privacy.adaptive import (
    AdaptiveConfig,
    centred_counts,
    release_centred_counts,
    update_thresholds,
)
from dpexp.privacy.broadcast import BroadcastExpander
from dpexp.privacy.grouping import ClippingMode, ParameterLayout, default_thresholds, partition
from dpexp.privacy.noise import Allocation, add_gaussian_noise_, noise_stds
from dpexp.privacy.per_example import Dense, NormMode, PerExampleGrad
from dpexp.privacy.rules import LayerRule, rule_for, supported_types
from dpexp.privacy.rules.functional import check_deterministic, functional_per_example_grads

Backend = Literal["bk", "ghost", "instantiate"]


def _versions(args: tuple, kwargs: dict[str, Any]) -> list[int]:
    return [t._version for t in (*args, *kwargs.values()) if torch.is_tensor(t)]


class _Anchor(torch.autograd.Function):
    """Makes the output of an input layer (whose input and parameters need no gradient) require one, so
    that backpropagation still reaches the layer and its output-gradient hook fires."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


@dataclass
class _Layer:
    """A module owning trainable parameters, with its rule (None: the exact torch.func fallback)."""

    name: str
    module: nn.Module
    rule: LayerRule | None
    params: dict[str, str]  # attribute name in the module ('weight') -> model parameter name


@dataclass
class _Use:
    """One call of a layer in the current forward pass: its inputs and their versions at call time."""

    layer: _Layer
    args: tuple
    kwargs: dict[str, Any]
    versions: list[int]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.args, *self.kwargs.values()) if torch.is_tensor(t)]


@dataclass
class _StepState:
    """Everything held between a forward pass and the end of its backward pass(es)."""

    batch_size: int | None = None
    num_uses: int = 0
    layer_uses: dict[str, int] = field(default_factory=dict)  # layer name -> calls in this forward pass
    pending: dict[int, int] = field(default_factory=dict)  # group -> uses not yet delivered
    arrived: dict[str, list[PerExampleGrad]] = field(default_factory=dict)  # parameter -> this pass
    norm_sq: dict[int, torch.Tensor] = field(default_factory=dict)
    coef: dict[int, torch.Tensor] = field(default_factory=dict)
    phase: str = "idle"  # idle | norm | sum | norm_and_sum
    held_budget: int = 0  # values flat bk may still hold in kept per-example gradients beyond their factors


class PrivacyEngine:
    """Per-example clipping (flat, per-layer or group-wise), noise and accounting for one model.

    Args:
        model: the network; every trainable parameter must belong to a module with a rule
            (``dpexp.privacy.rules``), otherwise construction fails naming the module.
        batch_size: expected logical batch size B (sample rate q = B / N); sums are divided by B.
        sample_size: N, the size of the private data set.
        max_grad_norm: C, the global clipping norm (per-group thresholds default to C / sqrt(K)).
        noise_multiplier: sigma; or give ``target_epsilon``, ``target_delta`` and ``epochs`` or ``steps``.
        clipping: "flat", "per_layer" or "groups" (``groups`` = lists of parameter names, or an int K).
        backend: "bk", "ghost" or "instantiate" (see the module docstring).
        thresholds: initial per-group thresholds C_k.
        adaptive: ``{"target_quantile", "quantile_lr", "budget_fraction", "rescale_to_global"}`` to adapt
            the thresholds by private quantile estimation (He et al. Algorithm 1).
        noise_allocation: "global", "equal_budget" or "weighted" (He et al. section 3.3).
        norm_mode: "auto" (ghost or instantiated norm per layer by cost), "ghost" or "instantiate".
        generic_fallback: give modules without a rule exact per-example gradients through ``torch.func``
            (``dpexp.privacy.rules.functional``; costs a second forward/backward of that module) instead
            of refusing them.
        generator: random generator for the noise, on the parameters' device (default: torch's global one).
        allow_approximation: let ``target_epsilon`` be calibrated with ``accountant="gdp"``, an approximation
            that can underestimate epsilon (``accounting.get_noise_multiplier`` refuses it otherwise).
        secure_mode: draw the gradient and clip-count noise from the secure sampler
            (``dpexp.privacy.noise.secure_standard_normal``: OS CSPRNG, sums of Gaussians against
            floating-point attacks; slower, not reproducible); refuses a ``generator``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        sample_size: int,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: float | None = None,
        steps: int | None = None,
        accountant: str = "rdp",
        clipping: ClippingMode = "flat",
        groups: Sequence[Sequence[str]] | int | None = None,
        backend: Backend = "bk",
        thresholds: Sequence[float] | None = None,
        adaptive: AdaptiveConfig | dict | None = None,
        noise_allocation: Allocation = "global",
        norm_mode: NormMode = "auto",
        generic_fallback: bool = True,
        generator: torch.Generator | None = None,
        allow_approximation: bool = False,
        secure_mode: bool = False,
    ) -> None:
        if batch_size < 1 or sample_size < 1:
            raise ValueError(f"batch_size ({batch_size}) and sample_size ({sample_size}) must be positive")
        if batch_size > sample_size:
            raise ValueError(f"batch_size {batch_size} exceeds the data set size {sample_size}")
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if backend not in ("bk", "ghost", "instantiate"):
            raise ValueError(f"unknown backend {backend!r}; valid: 'bk', 'ghost', 'instantiate'")
        if norm_mode not in ("auto", "ghost", "instantiate"):
            raise ValueError(f"unknown norm_mode {norm_mode!r}; valid: 'auto', 'ghost', 'instantiate'")
        self.model, self.batch_size, self.sample_size = model, batch_size, sample_size
        self.sample_rate = batch_size / sample_size
        self.max_grad_norm, self.backend, self.accountant = float(max_grad_norm), backend, accountant
        self.norm_mode: NormMode = "instantiate" if backend == "instantiate" else norm_mode
        self.noise_allocation, self.generator = noise_allocation, generator
        if secure_mode and generator is not None:
            raise ValueError(
                "secure_mode=True draws noise from the operating system's CSPRNG, never from a seed: pass "
                "generator=None, or secure_mode=False for reproducible noise."
            )
        self.allow_approximation, self.secure_mode = allow_approximation, secure_mode
        self.steps = 0

        self._recomputing = False
        self._layers, self._params = self._discover_layers(model, generic_fallback)
        layout = ParameterLayout(
            names=list(self._params),
            numel={n: p.numel() for n, p in self._params.items()},
            owners={n: [ly.name for ly in self._layers if n in ly.params.values()] for n in self._params},
        )
        self.groups = partition(layout, clipping, groups)
        self._group_of = {name: k for k, group in enumerate(self.groups) for name in group}
        self._shared = {name for name, owners in layout.owners.items() if len(owners) > 1}  # tied weights
        self._n_trainable = sum(layout.numel.values())
        self._group_dims = torch.tensor(
            [sum(layout.numel[n] for n in g) for g in self.groups], dtype=torch.float64
        )
        self.thresholds = self._initial_thresholds(thresholds)

        self.adaptive = AdaptiveConfig(**adaptive) if isinstance(adaptive, dict) else adaptive
        self.noise_multiplier = self._resolve_noise_multiplier(
            noise_multiplier, target_epsilon, target_delta, epochs, steps
        )
        if self.adaptive is not None and self.noise_multiplier > 0:
            self.gradient_noise_multiplier, self.count_noise_multiplier = accounting.split_noise_multiplier(
                self.noise_multiplier, len(self.groups), self.adaptive.budget_fraction
            )
        else:
            self.gradient_noise_multiplier, self.count_noise_multiplier = self.noise_multiplier, 0.0

        self._summed: dict[str, torch.Tensor] = {}
        device = next(iter(self._params.values())).device
        # sum_i (1[unclipped] - 1/2) per group, on the device (no host sync per group)
        self._centred_counts = torch.zeros(len(self.groups), dtype=torch.float64, device=device)
        self._state = self._new_state()
        self._anchor = torch.zeros((), requires_grad=True)
        self._handles: list[Any] = []
        self._optimizer_handles: list[Any] = []
        self._install_hooks()
        for p in self._params.values():
            p.requires_grad_(False)  # ghost differentiation: the engine forms these gradients itself

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _discover_layers(
        model: nn.Module, generic_fallback: bool
    ) -> tuple[list[_Layer], dict[str, nn.Parameter]]:
        names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        layers: list[_Layer] = []
        for mod_name, module in model.named_modules():
            if isinstance(module, _BatchNorm):
                raise ValueError(
                    f"module {mod_name!r} ({type(module).__name__}) mixes examples in a batch, which breaks "
                    "per-example privacy; replace it with GroupNorm or LayerNorm."
                )
            own = {attr: names[id(p)] for attr, p in module.named_parameters(recurse=False) if id(p) in names}
            if not own:
                continue
            rule = rule_for(module)
            if rule is None and generic_fallback:
                check_deterministic(mod_name, module)
                warnings.warn(
                    f"module {mod_name!r} ({type(module).__name__}) has no per-example gradient rule; its "
                    f"parameters {sorted(own)} use the exact but slower torch.func fallback.",
                    stacklevel=3,
                )
            elif rule is None:
                raise ValueError(
                    f"module {mod_name!r} of type {type(module).__name__} has trainable parameters "
                    f"{sorted(own)} but no per-example gradient rule. Supported types: {supported_types()}. "
                    "Freeze its parameters, replace the module, or register a rule with "
                    "dpexp.privacy.rules.register_rule."
                )
            if rule is not None and rule.check is not None:
                rule.check(module)
            layers.append(_Layer(mod_name, module, rule, own))
        params = {n: p for n, p in model.named_parameters() if id(p) in names}
        if not params:
            raise ValueError("the model has no trainable parameters")
        return layers, params

    def _initial_thresholds(self, thresholds: Sequence[float] | None) -> torch.Tensor:
        values = (
            default_thresholds(self.max_grad_norm, len(self.groups)) if thresholds is None else thresholds
        )
        values = list(values)
        if len(values) != len(self.groups) or any(c <= 0 for c in values):
            raise ValueError(f"need {len(self.groups)} positive thresholds (one per group), got {values}")
        return torch.tensor(values, dtype=torch.float64)

    def _resolve_noise_multiplier(
        self,
        noise_multiplier: float | None,
        target_epsilon: float | None,
        target_delta: float | None,
        epochs: float | None,
        steps: int | None,
    ) -> float:
        if noise_multiplier is not None:
            if noise_multiplier < 0:
                raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
            if noise_multiplier == 0:
                warnings.warn(
                    "noise_multiplier=0: no privacy (epsilon = inf); use only for testing.", stacklevel=3
                )
            return float(noise_multiplier)
        if target_epsilon is None or target_delta is None or (epochs is None and steps is None):
            raise ValueError("give noise_multiplier, or target_epsilon and target_delta with epochs or steps")
        total_steps = steps if steps is not None else math.ceil(epochs * self.sample_size / self.batch_size)
        return accounting.get_noise_multiplier(
            target_epsilon,
            target_delta,
            self.sample_rate,
            total_steps,
            accountant=self.accountant,
            allow_approximation=self.allow_approximation,
        )

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        expanded = [
            ly.module for ly in self._layers if ly.rule is not None and ly.rule.expand_broadcast_input
        ]
        self._handles.append(BroadcastExpander(self.model, expanded, active=lambda: not self._recomputing))
        for layer in self._layers:
            tap = layer.rule.tap if layer.rule is not None else None
            if tap is None:
                hook = partial(self._on_forward, layer)
                handle = layer.module.register_forward_hook(hook, with_kwargs=True)
            else:
                hook = partial(self._on_tap, layer)
                handle = layer.module.get_submodule(tap).register_forward_pre_hook(hook)
            self._handles.append(handle)

    def _on_forward(
        self, layer: _Layer, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: torch.Tensor
    ) -> Any:
        if not torch.is_grad_enabled() or self._recomputing:
            return None
        if not torch.is_tensor(output):
            raise TypeError(
                f"layer {layer.name!r} ({type(module).__name__}) returned {type(output).__name__}, but the "
                "privacy engine needs a tensor output to capture its gradient; freeze its parameters or "
                "register a rule for it."
            )
        return self._record_use(_Use(layer, args, kwargs, _versions(args, kwargs)), output)

    def _on_tap(self, layer: _Layer, tap: nn.Module, args: tuple) -> Any:
        """Forward pre-hook of a rule's tap: the gradient is captured at the tap's input ``args[0]``."""
        if not torch.is_grad_enabled() or self._recomputing:
            return None
        x = self._record_use(_Use(layer, args[:1], {}, _versions(args[:1], {})), args[0])
        return (x, *args[1:])

    def _record_use(self, use: _Use, tensor: torch.Tensor) -> torch.Tensor:
        """Count a use of a layer and hook the gradient of ``tensor`` (anchored if it needs none)."""
        state = self._state
        state.num_uses += 1
        state.layer_uses[use.layer.name] = state.layer_uses.get(use.layer.name, 0) + 1
        for k in {self._group_of[p] for p in use.layer.params.values()}:
            state.pending[k] = state.pending.get(k, 0) + 1
        if not tensor.requires_grad:
            tensor = _Anchor.apply(tensor, self._anchor)
        tensor.register_hook(partial(self._on_output_grad, use))
        return tensor

    def _on_output_grad(self, use: _Use, dy: torch.Tensor) -> None:
        state = self._state
        if state.phase == "idle":
            raise RuntimeError(
                "gradients of a model under a PrivacyEngine must be computed with "
                "engine.backward(per_example_loss), not loss.backward()"
            )
        layer = use.layer
        tensors = use.tensors
        if [t._version for t in tensors] != use.versions:
            raise RuntimeError(
                f"the input of layer {layer.name!r} was modified in place after the layer used it; "
                "per-example gradients would be wrong. Disable in-place operations (e.g. inplace=True)."
            )
        x = tensors[0]
        if x.shape[0] != state.batch_size or dy.shape[0] != state.batch_size:
            raise RuntimeError(
                f"layer {layer.name!r} saw a batch of {x.shape[0]} inputs / {dy.shape[0]} output gradients "
                f"but the loss has {state.batch_size} examples: inputs broadcast over the batch cannot be "
                "clipped per example. Expand them to the batch size before this layer."
            )
        grads = self._per_example_grads(use, dy)
        if state.phase != "norm":
            use.args, use.kwargs = (), {}  # last pass over this use: free its activation with the layer
        if state.phase == "sum":
            for attr, grad in grads.items():
                name = layer.params.get(attr)
                if name is not None:
                    self._accumulate(name, grad.weighted_sum(state.coef[self._group_of[name]]))
            return
        single_use = state.layer_uses[layer.name] == 1  # then its unshared parameters need no cross term
        for attr, grad in grads.items():
            name = layer.params.get(attr)
            if name is None:
                continue  # frozen parameter of a layer with trainable ones (e.g. a frozen bias)
            if self.backend == "instantiate":
                grad = Dense(grad.instantiate())
            elif self.backend == "bk" and state.pending[self._group_of[name]] == 1:
                # the group is clipped and summed right after this norm (fused per-layer); an instantiation
                # made for that may hold as many values as the trainable parameters (one transient)
                grad.retain(max_values=self._n_trainable)
            elif self.backend == "bk" and single_use and name not in self._shared:
                self._keep_instantiated_if_affordable(grad)
            self._add_norm_contribution(name, grad)
        for k in {self._group_of[p] for p in layer.params.values()}:
            state.pending[k] -= 1
            if state.pending[k] == 0:
                self._finish_group(k)

    def _keep_instantiated_if_affordable(self, grad: PerExampleGrad) -> None:
        """Flat bk: a layer's per-example gradients replace its activation and output gradient until the group
        finishes (the clipped sum is then a ``tensordot``) where they are smaller, or where the extra values
        fit in what is left of this backward pass's budget (one parameter-sized tensor)."""
        extra = grad.held_extra_values()
        if extra is None or extra > self._state.held_budget:
            return
        self._state.held_budget -= max(extra, 0)
        grad.retain(release=True)

    def _per_example_grads(self, use: _Use, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
        layer = use.layer
        if layer.rule is not None:
            grads = layer.rule.per_example_grads(layer.module, use.args[0], dy)
            missing = set(layer.params) - set(grads)
            if missing:  # never leave a trainable parameter without its per-example gradient
                raise RuntimeError(
                    f"the rule for layer {layer.name!r} ({type(layer.module).__name__}) gave no per-example "
                    f"gradient for its trainable parameters {sorted(missing)}; fix or replace the rule."
                )
            return grads
        self._recomputing = True
        try:
            return functional_per_example_grads(layer.module, list(layer.params), use.args, use.kwargs, dy)
        finally:
            self._recomputing = False

    # ------------------------------------------------------------------ clipping
    def _add_norm_contribution(self, name: str, grad: PerExampleGrad) -> None:
        """``||sum_u g_u||^2 = sum_u ||g_u||^2 + 2 sum_{u<v} <g_u, g_v>`` over the uses of a parameter."""
        state = self._state
        k = self._group_of[name]
        previous = state.arrived.setdefault(name, [])
        contribution = grad.norm_sq(self.norm_mode)
        for other in previous:
            contribution = contribution + 2 * grad.dot(other)
        state.norm_sq[k] = state.norm_sq.get(k, 0) + contribution.double()
        previous.append(grad)

    def _clipping_factors(self, k: int, norm_sq: torch.Tensor | None, batch_size: int) -> torch.Tensor:
        """``c_i = min(1, C_k / ||g_{i,k}||)`` (exactly 1 for g = 0) from squared group norms (None: all
        zero), shape (b,); counts the unclipped examples for adaptive thresholds."""
        if norm_sq is None:
            device = self._params[self.groups[k][0]].device
            norm_sq = torch.zeros(batch_size, dtype=torch.float64, device=device)
        norm = norm_sq.clamp_min(0).sqrt()
        threshold = float(self.thresholds[k])
        self._centred_counts[k] += centred_counts(norm, threshold)
        return threshold / norm.clamp_min(threshold)

    def _finish_group(self, k: int) -> None:
        state = self._state
        coef = self._clipping_factors(k, state.norm_sq.pop(k, None), state.batch_size)
        for name in self.groups[k]:
            grads = state.arrived.pop(name, [])
            if self.backend == "ghost":
                continue  # sums come from the second backward pass
            for grad in grads:
                self._accumulate(name, grad.weighted_sum(coef))
        state.coef[k] = coef

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        param = self._params[name]
        value = value.to(param.dtype)
        if name in self._summed:
            self._summed[name].add_(value)
        else:
            self._summed[name] = value  # a fresh tensor from weighted_sum: owned from here on

    # ------------------------------------------------------------------ public API
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters the engine clips, noises and updates, by name (their requires_grad is off)."""
        return dict(self._params)

    def add_per_example_gradients(self, grads: Mapping[str, PerExampleGrad]) -> None:
        """Clip and accumulate examples given by their per-example gradients instead of a loss: ``grads``
        maps parameter names to per-example gradients of one batch of n examples (a parameter left out has
        gradient 0). They are clipped group by group with the current thresholds and counted for adaptive
        thresholds exactly like examples of :meth:`backward`; the privacy audit's gradient canaries
        (Steinke et al. 2023) enter the mechanism this way."""
        unknown = sorted(set(grads) - set(self._params))
        if unknown:
            raise ValueError(f"add_per_example_gradients: {unknown[:5]} are not trainable parameters")
        sizes = {grad.batch_size for grad in grads.values()}
        if len(sizes) != 1:
            raise ValueError(f"add_per_example_gradients: need one batch size for all parameters: {sizes}")
        (size,) = sizes
        for name, grad in grads.items():
            if tuple(grad.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"add_per_example_gradients: {name!r} has shape {tuple(self._params[name].shape)}, "
                    f"the gradients {tuple(grad.shape)}"
                )
        for k, group in enumerate(self.groups):
            present = [name for name in group if name in grads]
            norm_sq = sum(grads[n].norm_sq(self.norm_mode).double() for n in present) if present else None
            coef = self._clipping_factors(k, norm_sq, size)
            for name in present:
                self._accumulate(name, grads[name].weighted_sum(coef))

    def backward(self, per_example_loss: torch.Tensor) -> None:
        """Accumulate ``sum_i clip(g_i)`` for one (micro-)batch; ``per_example_loss`` has shape (b,)."""
        if not torch.is_tensor(per_example_loss) or per_example_loss.dim() != 1:
            shape = (
                tuple(per_example_loss.shape) if torch.is_tensor(per_example_loss) else type(per_example_loss)
            )
            raise ValueError(
                f"engine.backward needs a 1-D tensor with one loss per example, got shape {shape}; "
                "use reduction='none' (and sum token losses per example)."
            )
        state = self._state
        if not state.num_uses:
            raise RuntimeError("no forward pass with gradients enabled was recorded before engine.backward")
        if state.batch_size != per_example_loss.shape[0]:
            state.batch_size = per_example_loss.shape[0]
        total = per_example_loss.sum()
        try:
            if self.backend == "ghost":
                state.phase = "norm"
                total.backward(retain_graph=True)
                self._finish_pending()
                state.phase = "sum"
                total.backward()
            else:
                state.phase = "norm_and_sum"
                total.backward()
                self._finish_pending()
        finally:
            self._state = self._new_state()

    def _new_state(self) -> _StepState:
        """Flat bk may hold one parameter-sized tensor of kept per-example gradients per backward pass."""
        return _StepState(held_budget=self._n_trainable)

    def _finish_pending(self) -> None:
        """Groups some of whose layers got no gradient (unused outputs) are finished with those at zero."""
        state = self._state
        for k in range(len(self.groups)):
            if state.pending.get(k, 0) > 0 or k not in state.coef:
                state.pending[k] = 0
                self._finish_group(k)

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer.step()`` privatise the accumulated sums first; returns the same optimizer."""
        handled = {id(p) for p in self._params.values()}
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self._params.items() if id(p) not in in_optimizer]
        if missing:
            raise ValueError(f"the optimizer does not update trainable parameters {missing[:5]}")
        extra = [
            p for g in optimizer.param_groups for p in g["params"] if id(p) not in handled and p.requires_grad
        ]
        if extra:
            raise ValueError(f"the optimizer updates {len(extra)} parameters the engine does not privatise")
        self._optimizer_handles = [
            optimizer.register_step_pre_hook(lambda *_: self._privatize()),
            optimizer.register_step_post_hook(lambda *_: self._end_step()),
        ]
        return optimizer

    def _privatize(self) -> None:
        """``p.grad = (sum_i clip(g_i) + z) / B``, ``z ~ N(0, std_k^2)`` per group: noise once per step."""
        stds = noise_stds(
            self.thresholds, self._group_dims, self.gradient_noise_multiplier, self.noise_allocation
        )
        for k, group in enumerate(self.groups):
            std = float(stds[k])
            for name in group:
                param = self._params[name]
                grad = self._summed.pop(name, None)
                if grad is None:
                    grad = torch.zeros_like(param)
                if std > 0:
                    add_gaussian_noise_(grad, std, self.generator, self.secure_mode)
                param.grad = grad.div_(self.batch_size)

    def _end_step(self) -> None:
        if self.adaptive is not None:
            released = release_centred_counts(
                self._centred_counts, self.count_noise_multiplier, self.generator, self.secure_mode
            )
            self.thresholds = update_thresholds(
                self.thresholds, released, self.batch_size, self.adaptive, self.max_grad_norm
            )
        self._summed.clear()
        self._centred_counts.zero_()
        self.steps += 1

    def get_epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Epsilon spent so far (all ``self.steps`` steps at sample rate q and noise multiplier sigma)."""
        if self.steps == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return accounting.get_epsilon(
            self.noise_multiplier,
            self.sample_rate,
            self.steps,
            delta,
            accountant=accountant or self.accountant,
        )

    def detach(self) -> nn.Module:
        """Remove every hook and give the parameters their ``requires_grad`` back."""
        for handle in [*self._handles, *self._optimizer_handles]:
            handle.remove()
        self._handles, self._optimizer_handles = [], []
        for p in self._params.values():
            p.requires_grad_(True)
        return self.model
