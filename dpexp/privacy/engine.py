"""The privacy engine: per-example clipping of parameter groups, noise, thresholds and accounting.

Life of one logical step (B = expected batch size, the same for every step)::

    engine = PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=C, noise_multiplier=sigma)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=lr))
    for micro_batch in logical_batch:           # forward hooks record each layer's input (capture)
        engine.backward(per_example_loss)       # output-gradient hooks clip and sum, group by group
    optimizer.step()                            # noise once, / B, inner step, adapt thresholds
    optimizer.zero_grad()

The engine wires its parts, each in a module of its own: :mod:`~dpexp.privacy.capture` records what the
layers see, :mod:`~dpexp.privacy.verification` establishes what the engine assumes of it (or refuses),
:mod:`~dpexp.privacy.clipping` turns per-example gradients into clipped sums by one of its strategies
(``bk``, ``ghost``, ``instantiate``), :mod:`~dpexp.privacy.noise` privatises them,
:mod:`~dpexp.privacy.adaptive` moves the thresholds and :mod:`~dpexp.privacy.accounting` says what it cost.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpexp.privacy import accounting
from dpexp.privacy import coordinate as coordinate_clipping
from dpexp.privacy.adaptive import (
    SENSITIVITY,
    AdaptiveConfig,
    release_statistics,
    split_noise_multiplier,
    update_thresholds,
    update_thresholds_from_norms,
)
from dpexp.privacy.aggregation import SingleProcess, StepAggregation
from dpexp.privacy.capture import Capture, Forward, Use, discover_layers, parameter_layout
from dpexp.privacy.clipping import CLIP_FUNCTIONS, ClipFunction, Clipper, StrategyName, make_strategy
from dpexp.privacy.grouping import ClippingMode, default_thresholds, partition
from dpexp.privacy.individual import IndividualPrivacy, check_group_indices
from dpexp.privacy.noise import Allocation, add_gaussian_noises_, noise_stds
from dpexp.privacy.per_example import Dense, NormMode, PerExampleGrad
from dpexp.privacy.sharding import LiveParameters, check_unsharded, local_gradient
from dpexp.privacy.verification import VerificationError, Verifier, check_outputs, check_use


class PrivacyEngine:
    """Per-example clipping (flat, per-layer or group-wise), noise and accounting for one model.

    Args:
        model: the network; every trainable parameter must belong to a module with a rule
            (``dpexp.privacy.rules``) or go through the exact ``torch.func`` fallback.
        batch_size: expected logical batch size B (sample rate q = B / N); sums are divided by B.
        sample_size: N, the size of the private data set.
        max_grad_norm: C, the global clipping norm (per-group thresholds default to C / sqrt(K)).
        noise_multiplier: sigma (0: no noise, for tests; solve it for a target epsilon with
            :func:`dpexp.privacy.accounting.get_noise_multiplier`), or a noise schedule: the sigma of every
            step (:mod:`dpexp.privacy.noise_schedule`), each step accounted with its own; the engine refuses
            a step beyond the schedule.
        accountant: the default accountant of :meth:`get_epsilon`.
        clipping: "flat", "per_layer" or "groups" (``groups`` = lists of parameter names, or an int K).
        strategy: "bk", "ghost" or "instantiate" (:mod:`dpexp.privacy.clipping`).
        thresholds: initial per-group thresholds C_k.
        adaptive: ``{"target_quantile", "quantile_lr", "budget_fraction", "rescale_to_global"}`` to adapt
            the thresholds by private quantile estimation (He et al. Algorithm 1), or ``{"method": "norm",
            "norm_factor", "bound_factor", "budget_fraction"}`` to set them from the privately released
            mean clipped norm (van der Veen et al. 2018): :class:`dpexp.privacy.adaptive.AdaptiveConfig`.
        noise_allocation: "global", "equal_budget" or "weighted" (He et al. section 3.3).
        norm_mode: "auto" (ghost or instantiated norm per layer by cost), "ghost" or "instantiate".
        generic_fallback: give modules without a rule exact per-example gradients through ``torch.func``
            (``dpexp.privacy.rules.functional``; costs a second forward/backward of that module) instead
            of refusing them.
        generator: random generator for the noise, on the parameters' device (default: torch's global one).
        verify_every_step: verify per-example structure and parameter uses on every micro-batch instead of
            on the first one of each input structure (:mod:`dpexp.privacy.verification`); for models whose
            forward takes data-dependent paths through their layers. Costs about one more backward pass.
        secure_mode: draw the gradient and clip-count noise from the secure sampler
            (``dpexp.privacy.noise.secure_standard_normal``: OS CSPRNG, sums of Gaussians against
            floating-point attacks; slower, not reproducible); refuses a ``generator``.
        clip_function: "standard" (``min(1, C_k / ||g||)``) or "automatic" (``C_k / (||g|| + gamma)``,
            AUTO-S of Bu et al.'s automatic clipping; fixed thresholds only):
            :func:`dpexp.privacy.clipping.clipping_factors`.
        automatic_stability: gamma of the automatic clip function (Bu et al. use 0.01).
        individual: individualized privacy (IDP-SGD, Boenisch et al. 2023;
            :mod:`dpexp.privacy.individual`): every example belongs to a privacy group g, given to
            :meth:`backward` as ``privacy_groups``. ``scaling``: example i is clipped to ``s_g C_k`` in every
            group k (the noise stays that of the base thresholds; fixed thresholds only, any clip function:
            ``||c_i g_i|| <= s_g C_k`` holds for both). ``sampling``: the caller samples group g at rate q_g
            (the engine clips every example at C_k). :meth:`get_epsilon` is then the largest group's,
            :meth:`get_epsilon_by_group` every group's.
        coordinate: coordinate-wise adaptive clipping, AdaCliP (Pichapati et al. 2019; Monir et al. 2024,
            sec. 3.2.3; :mod:`dpexp.privacy.coordinate`): each example's gradient is standardised
            coordinate by coordinate, ``(g_i - a) / b``, before it is clipped to C_k; noise is added in those
            coordinates and the released mean mapped back (``b w + a``); ``a`` and ``b`` follow the released
            gradients (no privacy cost). Every per-example gradient is instantiated (the transform has no
            factored form), with any strategy and clipping mode; parameters used twice in a forward, adaptive
            thresholds, automatic clipping and individual privacy are refused.
        aggregation: the processes that share each logical step (data parallel: every process clips its own
            share of the logical batch; :mod:`dpexp.privacy.aggregation`). Only the process with
            ``draws_noise`` adds noise, then the noised clipped sums and the noised adaptive statistics are
            summed over the processes before the division by B and the threshold update. Default: this
            process alone.
        sharded: the model's parameters are sharded by FSDP2 (``fully_shard``, reshard_after_forward off;
            :mod:`dpexp.privacy.sharding`): every parameter is looked up by name when used (the unsharded one
            from the forward to the end of the backward, the sharded one at the step), and each process
            releases its shard of the (aggregated) noised mean. Flat, per-layer and group-wise clipping with
            fixed or adaptive thresholds; coordinate-wise clipping is refused.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        sample_size: int,
        max_grad_norm: float,
        noise_multiplier: float | Sequence[float],
        accountant: str = "rdp",
        clipping: ClippingMode = "flat",
        groups: Sequence[Sequence[str]] | int | None = None,
        strategy: StrategyName = "bk",
        thresholds: Sequence[float] | None = None,
        adaptive: AdaptiveConfig | Mapping[str, Any] | None = None,
        noise_allocation: Allocation = "global",
        norm_mode: NormMode = "auto",
        generic_fallback: bool = True,
        generator: torch.Generator | None = None,
        verify_every_step: bool = False,
        secure_mode: bool = False,
        clip_function: ClipFunction = "standard",
        automatic_stability: float = 0.01,
        individual: IndividualPrivacy | None = None,
        coordinate: coordinate_clipping.CoordinateConfig | Mapping[str, Any] | None = None,
        aggregation: StepAggregation | None = None,
        sharded: bool = False,
    ) -> None:
        if batch_size < 1 or sample_size < 1:
            raise ValueError(f"batch_size ({batch_size}) and sample_size ({sample_size}) must be positive")
        if batch_size > sample_size:
            raise ValueError(f"batch_size {batch_size} exceeds the data set size {sample_size}")
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if norm_mode not in ("auto", "ghost", "instantiate"):
            raise ValueError(f"unknown norm_mode {norm_mode!r}; valid: 'auto', 'ghost', 'instantiate'")
        if clip_function not in CLIP_FUNCTIONS:
            raise ValueError(f"unknown clip_function {clip_function!r}; valid: {', '.join(CLIP_FUNCTIONS)}")
        if clip_function == "automatic" and not automatic_stability > 0:
            raise ValueError(f"automatic_stability must be > 0 (gamma of AUTO-S), got {automatic_stability}")
        if clip_function == "automatic" and adaptive is not None:
            raise ValueError(
                "clip_function='automatic' scales every example (no example is unclipped), so adaptive "
                "thresholds have no quantile to track: set adaptive=None (clip.engine.adaptive=null)"
            )
        if individual is not None and individual.variant == "scaling" and adaptive is not None:
            raise ValueError(
                "individual privacy (scaling) clips each example at s_g C_k, while adaptive thresholds "
                "release counts at C_k under a noise split accounted for one bound: use fixed thresholds "
                "(clip.engine.adaptive=null), or the sampling variant"
            )
        self.individual = individual
        self.coordinate = (
            coordinate_clipping.CoordinateConfig(**coordinate)
            if isinstance(coordinate, Mapping)
            else coordinate
        )
        clashes = [
            (feature, fix)
            for feature, fix, on in [
                ("adaptive thresholds", "clip.engine.adaptive=null", adaptive is not None),
                ("automatic clipping", "clip.engine.clip_function=standard", clip_function != "standard"),
                ("individual privacy", "privacy.individual.variant=none", individual is not None),
            ]
            if on and self.coordinate is not None
        ]
        if sharded and self.coordinate is not None:
            clashes.append(("sharded parameters (FSDP2)", "distributed=ddp"))
        if clashes:
            feature, fix = clashes[0]
            raise ValueError(
                f"coordinate-wise clipping (AdaCliP) adapts its own transform and does not combine with "
                f"{feature}: set {fix}, or clip.engine.coordinate=null"
            )
        schedule = None if isinstance(noise_multiplier, numbers.Real) else tuple(map(float, noise_multiplier))
        sigmas = (float(noise_multiplier),) if schedule is None else schedule
        if not sigmas or not all(sigma >= 0 for sigma in sigmas):
            raise ValueError(f"noise_multiplier must be >= 0 (every step's), got {noise_multiplier}")
        if min(sigmas) == 0:
            warnings.warn(
                "noise_multiplier=0: no privacy (epsilon = inf); use only for testing.", stacklevel=2
            )
        self.model, self.batch_size, self.sample_size = model, batch_size, sample_size
        self.sample_rate = batch_size / sample_size
        self.max_grad_norm, self.accountant = float(max_grad_norm), accountant
        self.noise_multipliers = schedule  # None: the constant sigmas[0] at every step
        self._constant_sigma = sigmas[0]
        if secure_mode and generator is not None:
            raise ValueError(
                "secure_mode=True draws noise from the operating system's CSPRNG, never from a seed: pass "
                "generator=None, or secure_mode=False for reproducible noise."
            )
        self.noise_allocation, self.generator, self.secure_mode = noise_allocation, generator, secure_mode
        self.aggregation: StepAggregation = SingleProcess() if aggregation is None else aggregation
        self.steps = 0

        layers, self._params = discover_layers(model, generic_fallback)
        self.sharded = sharded
        if sharded:
            self._params = LiveParameters(model, list(self._params))
        layout = parameter_layout(layers, self._params)
        owners = layout.owners
        self.groups = partition(layout, clipping, groups)
        self._group_dims = torch.tensor(
            [sum(layout.numel[n] for n in g) for g in self.groups], dtype=torch.float64
        )
        self.strategy = make_strategy(strategy, sum(layout.numel.values()))
        self.norm_mode: NormMode = "instantiate" if self.strategy.name == "instantiate" else norm_mode
        shared = {name for name, owned_by in owners.items() if len(owned_by) > 1}  # tied weights
        self.adaptive = AdaptiveConfig(**adaptive) if isinstance(adaptive, Mapping) else adaptive
        norm_based = self.adaptive is not None and self.adaptive.method == "norm"
        self._clipper = Clipper(
            self.groups,
            self._params,
            shared,
            self._initial_thresholds(thresholds),
            self.strategy,
            self.norm_mode,
            clip_function,
            automatic_stability,
            statistic=None if self.adaptive is None else "norm" if norm_based else "count",
            bound_factor=self.adaptive.bound_factor if norm_based else 1.0,
            transform=None if self.coordinate is None else self._standardise,
        )
        if self.coordinate is not None:  # m_0 = 0, v_0 = initial_variance (AdaCliP's state)
            self._mean = {n: torch.zeros_like(p.detach()) for n, p in self._params.items()}
            start = self.coordinate.initial_variance
            self._variance = {n: torch.full_like(p.detach(), start) for n, p in self._params.items()}
            self._refresh_scales()

        self._verifier = Verifier(model, self._params, owners, verify_every_step)
        self._capture = Capture(
            model, layers, self._on_output_grad, self._verifier.begin_forward, self._verifier.end_forward
        )
        self._phase = "idle"  # idle | probe | first | second (the backward pass under way)
        self._refusal: VerificationError | None = None
        self._optimizer_handles: list[Any] = []
        self._verifier.release_parameters()  # ghost differentiation: the engine forms these gradients itself

    def _initial_thresholds(self, thresholds: Sequence[float] | None) -> torch.Tensor:
        values = (
            default_thresholds(self.max_grad_norm, len(self.groups)) if thresholds is None else thresholds
        )
        values = list(values)
        if len(values) != len(self.groups) or any(c <= 0 for c in values):
            raise ValueError(f"need {len(self.groups)} positive thresholds (one per group), got {values}")
        return torch.tensor(values, dtype=torch.float64)

    def _refresh_scales(self) -> None:
        """AdaCliP's ``b_t`` of every parameter from the variance estimates, normalised within each group."""
        self._scale = {}
        for group in self.groups:
            scales = coordinate_clipping.group_scales([self._variance[n] for n in group], self.coordinate)
            self._scale.update(zip(group, scales, strict=True))

    def _standardise(self, name: str, grad: PerExampleGrad) -> PerExampleGrad:
        """``(g_i - a) / b`` of one parameter's per-example gradients, instantiated (the transform is
        elementwise, so it has no factored form)."""
        return Dense(coordinate_clipping.standardise(grad.instantiate(), self._mean[name], self._scale[name]))

    # ------------------------------------------------------------------ state
    @property
    def thresholds(self) -> torch.Tensor:
        """The current per-group thresholds C_k, shape (K,)."""
        return self._clipper.thresholds

    @thresholds.setter
    def thresholds(self, value: torch.Tensor) -> None:
        self._clipper.thresholds = value

    @property
    def adaptive_statistics(self) -> torch.Tensor:
        """This step's statistic per group so far, before noise, shape (K,): what adaptive thresholds release,
        ``sum_i (1[||g_{i,k}|| <= C_k] - 1/2)`` (quantile; sensitivity 1/2) or ``sum_i min(||g_{i,k}||,
        beta C_k)`` (norm; sensitivity beta C_k); zeros without adaptive thresholds (nothing is counted)."""
        return self._clipper.statistics.clone()

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters the engine clips, noises and updates, by name (their requires_grad is off)."""
        return dict(self._params)

    # ------------------------------------------------------------------ backward
    def backward(self, per_example_loss: torch.Tensor, privacy_groups: torch.Tensor | None = None) -> None:
        """Accumulate ``sum_i clip(g_i)`` for one (micro-)batch; ``per_example_loss`` has shape (b,).
        ``privacy_groups`` (b,): every example's privacy group under individualized privacy (required with
        the scaling variant, whose bounds depend on it; refused without individual privacy)."""
        if not torch.is_tensor(per_example_loss) or per_example_loss.dim() != 1:
            shape = (
                tuple(per_example_loss.shape) if torch.is_tensor(per_example_loss) else type(per_example_loss)
            )
            raise ValueError(
                f"engine.backward needs a 1-D tensor with one loss per example, got shape {shape}; "
                "use reduction='none' (and sum token losses per example)."
            )
        scales = self._example_scales(privacy_groups, per_example_loss.shape[0])
        self._check_not_refused()
        forward = self._capture.take()
        if not forward.model_calls:
            raise RuntimeError(
                "no forward pass of the model given to the PrivacyEngine with gradients enabled was recorded "
                "before engine.backward: call that model (its hooks verify the forward), or give the engine "
                "the module you call."
            )
        self._batch_size = per_example_loss.shape[0]
        if self.sharded:
            check_unsharded(self._params)
        try:
            probing = self._verifier.start_backward(forward, self._batch_size)
            if probing:
                self._verifier.check_independence(
                    self.model, self._capture.replaying, forward.uses, self._batch_size
                )
                self._phase = "probe"
                self._verifier.run_probe(per_example_loss)
            self._verifier.release_parameters()
            total = per_example_loss.sum()
            passes = self.strategy.passes
            self._phase = "first"
            self._clipper.begin(forward, self._batch_size, scales=scales)
            total.backward(retain_graph=passes > 1)
            _check_read(forward)
            if probing:
                self._verifier.after_first_pass()
            self._clipper.finish_pending()
            if passes > 1:
                self._phase = "second"
                self._clipper.begin(forward, self._batch_size, second=True)
                total.backward()
                _check_read(forward)
        except BaseException as error:  # sums of this step may be partial: no step is taken from here on
            self._refusal = error if isinstance(error, VerificationError) else _failed_backward(error)
            raise
        finally:
            self._phase = "idle"
            self._clipper.end()
            self._verifier.end_backward()

    def _example_scales(self, privacy_groups: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
        """The per-example bound scales ``s_{g(i)}`` (b,) of the scaling variant, None otherwise."""
        if privacy_groups is None:
            if self.individual is not None and self.individual.variant == "scaling":
                raise ValueError(
                    "individual privacy (scaling) clips each example at its group's bound: pass "
                    "engine.backward(per_example_loss, privacy_groups=...) with one group per example"
                )
            return None
        if self.individual is None:
            raise ValueError(
                "privacy_groups given to an engine built without individual privacy (individual=)"
            )
        check_group_indices(privacy_groups, self.individual.num_groups)
        if privacy_groups.shape[0] != batch_size:
            raise ValueError(
                f"privacy_groups has {privacy_groups.shape[0]} entries for {batch_size} per-example losses"
            )
        if self.individual.variant != "scaling":
            return None
        return self.individual.example_scales(privacy_groups)

    def _on_output_grad(self, use: Use, dy: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """A use's output gradient (a tuple: those of a rule-less layer's several outputs), in the probe or a
        plain pass: checked, turned into per-example gradients, handed to the clipper."""
        if self._phase == "idle":
            raise RuntimeError(
                "gradients of a model under a PrivacyEngine must be computed with "
                "engine.backward(per_example_loss), not loss.backward()"
            )
        if isinstance(dy, tuple):
            dy = check_outputs(use, dy, self._batch_size)
        layouts = check_use(use, dy, self._batch_size)
        layout = self._verifier.layout(use, dy, layouts, self._phase, self._batch_size)
        if self._phase == "probe":
            return
        dy = layout.batch_first(dy, self._batch_size)  # folded or transposed to (b, ...) for the rule
        verifying = self._verifier.probe is not None
        grads = self._capture.per_example_grads(use, dy, layout)
        if verifying and self._phase == "first":
            self._verifier.add_engine_sums(use, grads)
        if self._phase == "second" or self.strategy.passes == 1:
            use.release()
        self._clipper.deliver(use, grads)

    def add_per_example_gradients(self, grads: Mapping[str, PerExampleGrad]) -> None:
        """Clip and accumulate examples given by their per-example gradients instead of a loss: ``grads``
        maps parameter names to per-example gradients of one batch of n examples (a parameter left out has
        gradient 0). They are clipped group by group with the current thresholds and counted for adaptive
        thresholds exactly like examples of :meth:`backward`; the privacy audit's gradient canaries
        (Steinke et al. 2023) enter the mechanism this way."""
        self._check_not_refused()
        unknown = sorted(set(grads) - set(self._params))
        if unknown:
            raise ValueError(f"add_per_example_gradients: {unknown[:5]} are not trainable parameters")
        sizes = {grad.batch_size for grad in grads.values()}
        if len(sizes) != 1:
            raise ValueError(f"add_per_example_gradients: need one batch size for all parameters: {sizes}")
        for name, grad in grads.items():
            if tuple(grad.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"add_per_example_gradients: {name!r} has shape {tuple(self._params[name].shape)}, "
                    f"the gradients {tuple(grad.shape)}"
                )
        self._clipper.add_examples(grads, sizes.pop())

    def clipped_sum_so_far(self, name: str) -> torch.Tensor:
        """A copy of this step's clipped sum for parameter ``name`` as accumulated so far, before noise (zeros
        if nothing touched it). Not private: the white-box privacy audit reads it to take the known examples'
        part out of a canary's score (:mod:`dpexp.audit`); a training loop must never release it."""
        if name not in self._params:
            raise ValueError(f"clipped_sum_so_far: {name!r} is not a trainable parameter")
        total = self._clipper.sums.get(name)
        return torch.zeros_like(self._params[name]) if total is None else total.detach().clone()

    def _check_not_refused(self) -> None:
        if self._refusal is not None:
            raise VerificationError(f"the engine refused this model earlier: {self._refusal}")

    # ------------------------------------------------------------------ the step
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

    @property
    def noise_multiplier(self) -> float:
        """sigma of the current step (``self.steps``): the constant one, or the schedule's."""
        if self.noise_multipliers is None:
            return self._constant_sigma
        if self.steps >= len(self.noise_multipliers):
            raise RuntimeError(
                f"the noise schedule has {len(self.noise_multipliers)} steps, all taken: another step would "
                "spend privacy that was never accounted for. Build the engine with a longer schedule."
            )
        return self.noise_multipliers[self.steps]

    @property
    def gradient_noise_multiplier(self) -> float:
        """sigma of this step's gradient noise: sigma, or sigma_new of He et al. Prop. 3.1 with adaptive
        thresholds (:func:`dpexp.privacy.adaptive.split_noise_multiplier`)."""
        return self._split_noise()[0]

    @property
    def count_noise_multiplier(self) -> float:
        """sigma_b of this step's clip counts (0 without adaptive thresholds)."""
        return self._split_noise()[1]

    def _split_noise(self) -> tuple[float, float]:
        sigma = self.noise_multiplier
        if self.adaptive is None or sigma == 0:
            return sigma, 0.0
        return split_noise_multiplier(
            sigma, len(self.groups), self.adaptive.budget_fraction, SENSITIVITY[self.adaptive.method]
        )

    def _privatize(self) -> None:
        """``p.grad = (sum_i clip(g_i) + z) / B``, ``z ~ N(0, std_k^2)`` per group: noise once per step (drawn
        by the one process of the aggregation that draws, then the sums of all its processes added)."""
        self._check_not_refused()
        stds = noise_stds(
            self.thresholds, self._group_dims, self.gradient_noise_multiplier, self.noise_allocation
        )
        stds = stds.tolist()  # one conversion, not one per parameter
        sums = self._clipper.take_sums()
        if self.aggregation.draws_noise:
            pieces = [(sums[name], stds[k]) for k, group in enumerate(self.groups) for name in group]
            add_gaussian_noises_([p for p in pieces if p[1] > 0], self.generator, self.secure_mode)
        ordered = [sums[name] for group in self.groups for name in group]
        self.aggregation.sum_(ordered)
        torch._foreach_div_(ordered, self.batch_size)  # one multi-tensor kernel on an accelerator
        released, noise_std = {}, {}
        for k, group in enumerate(self.groups):
            std = stds[k]
            for name in group:
                grad = sums[name]
                if self.coordinate is not None:  # back from the standardised coordinates
                    grad = coordinate_clipping.unstandardise(grad, self._mean[name], self._scale[name])
                    released[name], noise_std[name] = grad, self._scale[name] * (std / self.batch_size)
                self._params[name].grad = local_gradient(self._params[name], grad) if self.sharded else grad
        if self.coordinate is not None:  # the next transform, from released values only (equal on all ranks)
            self._mean, self._variance = coordinate_clipping.update_moments(
                self._mean, self._variance, released, noise_std, self.coordinate
            )
            self._refresh_scales()

    def _end_step(self) -> None:
        if self.adaptive is not None:
            norm_based = self.adaptive.method == "norm"
            std = self.count_noise_multiplier  # in units of the statistic's sensitivity (1/2, or beta C_k)
            std = std * self.adaptive.bound_factor * self.thresholds if norm_based else std
            statistics = self._clipper.statistics
            if self.aggregation.draws_noise:
                released = release_statistics(statistics, std, self.generator, self.secure_mode)
            else:
                released = statistics.double().cpu()
            self.aggregation.sum_([released])
            update = update_thresholds_from_norms if norm_based else update_thresholds
            self.thresholds = update(
                self.thresholds, released, self.batch_size, self.adaptive, self.max_grad_norm
            )
        self._clipper.end_step()
        self.steps += 1

    def get_epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Epsilon spent so far (all ``self.steps`` steps at sample rate q, each at its noise multiplier).
        Under individualized privacy the largest group's (the guarantee every example has; never one that
        hides a weaker group): :meth:`get_epsilon_by_group` gives each."""
        if self.individual is not None:
            return max(self.get_epsilon_by_group(delta, accountant))
        if self.steps == 0:
            return 0.0
        sigmas, repeat = self._spent_sigmas()
        return accounting.get_schedule_epsilon(
            sigmas, self.sample_rate, delta, accountant or self.accountant, repeat=repeat
        )

    def get_epsilon_by_group(self, delta: float, accountant: str | None = None) -> list[float]:
        """Epsilon spent so far by every privacy group g (individualized privacy): its steps at rate q_g and
        noise multipliers ``sigma_t / s_g`` (:meth:`IndividualPrivacy.group_epsilon`)."""
        if self.individual is None:
            raise ValueError("get_epsilon_by_group: this engine has no individual privacy groups")
        if self.steps == 0:
            return [0.0] * self.individual.num_groups
        sigmas, repeat = self._spent_sigmas()
        return [
            self.individual.group_epsilon(sigmas, delta, accountant or self.accountant, g, repeat)
            for g in range(self.individual.num_groups)
        ]

    def _spent_sigmas(self) -> tuple[list[float], int]:
        """The noise multipliers of the steps taken, as (sigmas, times each)."""
        if self.noise_multipliers is None:
            return [self._constant_sigma], self.steps
        return list(self.noise_multipliers[: self.steps]), 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the engine changes as it trains, for a checkpoint between steps: the step count, the
        thresholds and the noise generator's state (None when it draws from torch's global generator, whose
        state the caller saves; secure mode has no state to save: its redone steps draw fresh noise)."""
        if self._clipper.sums:
            raise RuntimeError("PrivacyEngine.state_dict() between steps only: clipped sums are pending")
        state = {
            "steps": self.steps,
            "thresholds": self.thresholds.clone(),
            "generator": None if self.generator is None else self.generator.get_state(),
        }
        if self.coordinate is not None:
            state["coordinate"] = {"mean": _cloned(self._mean), "variance": _cloned(self._variance)}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of an engine built the same way."""
        thresholds = torch.as_tensor(state["thresholds"])
        if thresholds.shape != self.thresholds.shape:
            raise ValueError(
                f"the state has {thresholds.numel()} thresholds, this engine clips {len(self.groups)} groups"
            )
        if (state["generator"] is None) != (self.generator is None):
            raise ValueError("the state and this engine disagree on whether the noise has its own generator")
        if ("coordinate" in state) != (self.coordinate is not None):
            raise ValueError("the state and this engine disagree on coordinate-wise clipping (AdaCliP)")
        self.steps = int(state["steps"])
        self.thresholds = thresholds.to(self.thresholds)
        if self.coordinate is not None:
            self._mean = {n: t.to(self._mean[n]) for n, t in state["coordinate"]["mean"].items()}
            self._variance = {n: t.to(self._variance[n]) for n, t in state["coordinate"]["variance"].items()}
            self._refresh_scales()
        if self.generator is not None:
            self.generator.set_state(state["generator"])

    def detach(self) -> nn.Module:
        """Remove every hook and give the parameters their ``requires_grad`` back."""
        self._capture.remove()
        self._verifier.remove()
        for handle in self._optimizer_handles:
            handle.remove()
        self._optimizer_handles = []
        for p in self._params.values():
            p.requires_grad_(True)
        return self.model


def _check_read(forward: Forward) -> None:
    """Refuse a backward after which a layer's rule still waits for gradients it reads inside the call
    (:meth:`~dpexp.privacy.capture.Forward.unread`): its per-example gradients were never formed, and
    finishing its groups without them would count them as zero."""
    unread = forward.unread()
    if unread:
        raise VerificationError(
            f"layers {unread}: their outputs got a gradient but not every node inside the call that their "
            "rules read, so their per-example gradients were never formed; the rules' graph reads do not "
            "hold for this model (report it with the model's type), or freeze those layers"
        )


def _failed_backward(error: BaseException) -> VerificationError:
    """The refusal kept after a backward that raised ``error`` part-way (an interrupt too): some groups'
    clipped sums of the step may be formed and others not, and a step on them would release a gradient
    nobody chose."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return VerificationError(
        f"a backward of this engine failed part-way ({type(error).__name__}: {first}), so this step's sums "
        "may be partial; build a new engine once its cause is fixed"
    )


def _cloned(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}
