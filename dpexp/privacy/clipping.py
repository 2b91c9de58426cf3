"""Per-example clipping of parameter groups: the clipped sum ``sum_i c_{i,k} g_{i,k}`` of every group k, with
``c_{i,k} = min(1, C_k / ||g_{i,k}||)``, formed from the per-example gradients that the layers deliver
during backpropagation.

Strategies (how the clipped sums are obtained):

* ``bk``: book-keeping (Bu et al. 2023, Algorithm 1). One backward pass; a group is clipped and summed as
  soon as backpropagation has delivered every use of it (He et al. 2023, section 3.1: per-layer clipping is
  fused into backpropagation and each layer's tensors are freed right away; a flat group completes at the
  input layer). Parameter gradients are never computed by autograd ("ghost differentiation"): the engine
  forms ``a^T diag(c) g`` itself.
* ``ghost``: ghost clipping (Li et al. 2022, section 4): a first backward computes only norms, a second one
  the clipped sums with the now known factors; nothing is held across the first backward.
* ``instantiate``: per-example gradients are materialised (the Opacus way), for reference.

Norms use the ghost norm or instantiation per layer by cost (``norm_mode="auto"``, BK-MixOpt: the ghost
norm's ``T^2 (L + R)`` against instantiation's ``T L R``, with a memory cap; see
:mod:`dpexp.privacy.per_example`).
The book-keeping strategy keeps instantiated per-example gradients, so that the clipped sum is
``tensordot(c, g)`` instead of a second matmul over T (its retention policy, :meth:`BookKeeping.represent`):

* in fused per-layer clipping, for linear layers whose per-example gradients hold at most 4x the values of
  the layer's activation and output gradient (a transient: one layer at a time);
* in flat clipping, for single-use untied layers whose per-example gradients are smaller than those factors,
  or (linear layers) larger by at most what is left of a budget of one parameter-sized tensor per backward
  pass: they wait for the input layer, so the budget bounds the memory they add.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from dpexp.privacy.adaptive import centred_counts, clipped_norm_sums
from dpexp.privacy.capture import Forward, Use
from dpexp.privacy.per_example import Dense, NormMode, PerExampleGrad

StrategyName = Literal["bk", "ghost", "instantiate"]


def finiteness_on_host(device: torch.device) -> bool:
    """Whether the clipper asks the host if all of a group's norms were finite, to sum the group's
    per-example gradients as they are, rather than zeroing those of the examples whose norm was not on the
    device (:meth:`PerExampleGrad.masked`: a pass over the factors, nothing awaited). On CPU the answer is
    ready, the kernels having run in the call. On an accelerator each question stops the host until the
    device has run everything queued, after which the device waits for the next launches: once per group,
    ~150 times in a per-layer GPT-2 step."""
    return device.type == "cpu"


Transform = Callable[[str, PerExampleGrad], PerExampleGrad]  # (parameter name, per-example gradient)


@dataclass
class RetentionBudget:
    """Values that flat book-keeping may still hold, in one backward pass, in instantiated per-example
    gradients beyond the factors they replace."""

    left: int

    def take(self, extra: int | None) -> bool:
        """Spend ``extra`` values (negative: fewer than the factors) if they fit; None never fits."""
        if extra is None or extra > self.left:
            return False
        self.left -= max(extra, 0)
        return True


@dataclass
class Delivery:
    """How a use's per-example gradient of one parameter will be consumed."""

    fused: bool  # its group is clipped right after this norm (the last use of the group)
    alone: bool  # the only use of an untied parameter in this pass (no cross term will follow)


class ClippingStrategy:
    """One way of forming the clipped sums; the default is the one-pass flow without retention. A strategy
    sees the number of trainable parameters (a bound for what it may hold)."""

    name: str
    passes: int = 1  # backward passes per micro-batch
    sums_at_norms: bool = True  # clipped sums formed when a group's norms are complete (else: second pass)

    def __init__(self, n_trainable: int) -> None:
        self.n_trainable = n_trainable

    def retention_budget(self) -> RetentionBudget:
        """The budget of one backward pass (none by default)."""
        return RetentionBudget(0)

    def represent(self, grad: PerExampleGrad, delivery: Delivery, budget: RetentionBudget) -> PerExampleGrad:
        """The form in which ``grad`` is held until its group is clipped."""
        return grad


class BookKeeping(ClippingStrategy):
    name = "bk"

    def retention_budget(self) -> RetentionBudget:
        """One parameter-sized tensor per backward pass."""
        return RetentionBudget(self.n_trainable)

    def represent(self, grad: PerExampleGrad, delivery: Delivery, budget: RetentionBudget) -> PerExampleGrad:
        if delivery.fused:
            # an instantiation made for the fused sum may hold as many values as the trainable parameters
            grad.retain(max_values=self.n_trainable)
        elif delivery.alone and budget.take(grad.held_extra_values()):
            grad.retain(release=True)  # kept until the group finishes; its factors are dropped
        return grad


class Ghost(ClippingStrategy):
    name = "ghost"
    passes = 2
    sums_at_norms = False


class Instantiate(ClippingStrategy):
    name = "instantiate"

    def represent(self, grad: PerExampleGrad, delivery: Delivery, budget: RetentionBudget) -> PerExampleGrad:
        return Dense(grad.instantiate())


STRATEGIES: dict[str, type[ClippingStrategy]] = {cls.name: cls for cls in (BookKeeping, Ghost, Instantiate)}


def make_strategy(name: StrategyName, n_trainable: int) -> ClippingStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown clipping strategy {name!r}; valid: {', '.join(map(repr, STRATEGIES))}")
    return STRATEGIES[name](n_trainable)


@dataclass
class _Pass:
    """Everything held within one backward pass of one micro-batch."""

    batch_size: int
    second: bool  # the ghost strategy's second pass: sums with the known factors
    scales: torch.Tensor | None  # per-example bound scales s_i (b,) of individualized privacy, or None (1)
    calls: Counter[str]  # layer name -> calls in the forward
    pending: dict[int, int]  # group -> uses not yet delivered
    budget: RetentionBudget
    arrived: dict[str, list[PerExampleGrad]] = field(default_factory=dict)  # parameter -> this pass
    norm_sq: dict[int, torch.Tensor] = field(default_factory=dict)


ClipFunction = Literal["standard", "automatic"]
CLIP_FUNCTIONS = ("standard", "automatic")


def clipping_factors(
    norm: torch.Tensor,
    threshold: float | torch.Tensor,
    function: ClipFunction = "standard",
    stability: float = 0.01,
) -> torch.Tensor:
    """Per-example factors ``c_i`` (shape (b,)) from per-example group norms ``||g_i||`` (b,), so that
    ``||c_i g_i|| <= C`` (the sensitivity of the clipped sum); ``threshold`` is C, or one bound per example
    (b,), ``C_i = s_i C`` (the scaling variant of individualized privacy, Boenisch et al. 2023;
    :mod:`dpexp.privacy.individual`), and then ``||c_i g_i|| <= C_i``:

    * ``standard``: ``c_i = min(1, C / ||g_i||)`` (exactly 1 for g = 0; Abadi et al. 2016, eq. in Alg. 1);
    * ``automatic``: ``c_i = C / (||g_i|| + gamma)``, per-example normalisation AUTO-S (Bu et al., "Automatic
      clipping", eq. 4.1, scaled by C so that the sensitivity stays C: ``||c_i g_i|| < C``), with the
      stability constant ``gamma = stability > 0``; no example is left unscaled and C acts as a learning-rate
      factor only."""
    if function == "standard":
        return threshold / norm.clamp_min(threshold)
    if function == "automatic":
        return threshold / (norm + stability)
    raise ValueError(f"unknown clip function {function!r}; valid: {', '.join(CLIP_FUNCTIONS)}")


class Clipper:
    """Clipping of one logical step: per-example group norms accumulated use by use (with the cross terms of
    tied parameters), clipping factors once a group's last use has arrived, clipped sums accumulated across
    micro-batches, and the statistic adaptive thresholds release (:mod:`dpexp.privacy.adaptive`): the centred
    clip counts (``statistic="count"``) or the norms clipped at ``bound_factor`` times the threshold
    (``"norm"``); None without adaptive thresholds (nothing is counted: ~7 launches a group on a GPU).

    ``groups`` partition the trainable parameters (:mod:`dpexp.privacy.grouping`), ``thresholds`` has shape
    (K,), ``shared`` names the parameters used by more than one layer. ``transform``: every per-example
    gradient is mapped by it before its norm and sum (AdaCliP's standardisation,
    :mod:`dpexp.privacy.coordinate`), which is affine, so only parameters with a single use are accepted.
    """

    def __init__(
        self,
        groups: list[list[str]],
        params: Mapping[str, nn.Parameter],
        shared: set[str],
        thresholds: torch.Tensor,
        strategy: ClippingStrategy,
        norm_mode: NormMode,
        function: ClipFunction = "standard",
        stability: float = 0.01,
        statistic: str | None = "count",
        bound_factor: float = 1.0,
        transform: Transform | None = None,
    ) -> None:
        self.groups, self.params, self.shared = groups, params, shared
        self.transform = transform
        self.statistic, self.bound_factor = statistic, bound_factor
        self.function, self.stability = function, stability
        self.group_of = {name: k for k, group in enumerate(groups) for name in group}
        self.thresholds = thresholds
        self.strategy, self.norm_mode = strategy, norm_mode
        self.n_trainable = sum(p.numel() for p in params.values())
        self.sums: dict[str, torch.Tensor] = {}
        device = next(iter(params.values())).device
        # per group, on the device (no host sync): sum_i (1[unclipped] - 1/2) or sum_i min(||g_i||, L)
        self.statistics = torch.zeros(len(groups), dtype=torch.float64, device=device)
        self.coef: dict[int, torch.Tensor] = {}  # clipping factors of the current micro-batch, by group
        # per group: the examples whose norm was finite, (b,) bool; None where all were, as asked on the host
        self.finite: dict[int, torch.Tensor | None] = {}
        self._ask_host = finiteness_on_host(device)
        self._pass: _Pass | None = None

    @property
    def thresholds(self) -> torch.Tensor:
        """C_k, shape (K,) (on the CPU); each group's also as a Python float, read once per assignment, not
        once per group and micro-batch."""
        return self._thresholds

    @thresholds.setter
    def thresholds(self, value: torch.Tensor) -> None:
        self._thresholds, self._bounds = value, [float(c) for c in value.tolist()]

    # ------------------------------------------------------------------ one micro-batch
    def begin(
        self, forward: Forward, batch_size: int, second: bool = False, scales: torch.Tensor | None = None
    ) -> None:
        """Start a backward pass over the uses ``forward`` recorded (the second pass of ghost clipping
        reuses the factors of the first). ``scales`` (b,): example i is clipped to ``s_i C_k`` in every
        group k (individualized privacy, scaling variant); None: to ``C_k``."""
        pending: Counter[int] = Counter(
            k for use in forward.uses for k in {self.group_of[p] for p in use.layer.params.values()}
        )
        if not second:
            self.coef = {}
        self._pass = _Pass(
            batch_size, second, scales, forward.calls, dict(pending), self.strategy.retention_budget()
        )

    def deliver(self, use: Use, grads: Mapping[str, PerExampleGrad]) -> None:
        """One use's per-example gradients: norm contributions (first pass; groups whose last use this was
        are clipped), or clipped sums with the known factors (second pass)."""
        state, layer = self._pass, use.layer
        single_use = state.calls[layer.name] == 1  # then its unshared parameters need no cross term
        if state.second:
            for attr, grad in grads.items():
                name = layer.params.get(attr)
                if name is not None:
                    grad = self._transformed(name, grad, single_use)
                    self._accumulate(name, self._clipped_sum(grad, self.group_of[name]))
            return
        for attr, grad in grads.items():
            name = layer.params.get(attr)
            if name is None:
                continue  # frozen parameter of a layer with trainable ones (e.g. a frozen bias)
            grad = self._transformed(name, grad, single_use)
            delivery = Delivery(
                fused=state.pending[self.group_of[name]] == 1, alone=single_use and name not in self.shared
            )
            self._add_norm_contribution(name, self.strategy.represent(grad, delivery, state.budget))
        for k in {self.group_of[p] for p in layer.params.values()}:
            state.pending[k] -= 1
            if state.pending[k] == 0:
                self._finish_group(k)

    @torch.no_grad()
    def finish_pending(self) -> None:
        """Groups some of whose uses got no gradient (unused outputs) are finished with those at zero. This
        runs after autograd's backward, where gradient mode is on again: without ``no_grad`` the sums of
        layers whose captured input requires gradients would carry an autograd graph (and their in-place
        noise would fail)."""
        state = self._pass
        for k in range(len(self.groups)):
            if state.pending.get(k, 0) > 0 or k not in self.coef:
                state.pending[k] = 0
                self._finish_group(k)

    def end(self) -> None:
        self._pass = None

    # ------------------------------------------------------------------ explicit examples
    @torch.no_grad()
    def add_examples(self, grads: Mapping[str, PerExampleGrad], batch_size: int) -> None:
        """Clip and accumulate examples given by their per-example gradients (a parameter left out has
        gradient 0), group by group with the current thresholds, counted like any other examples."""
        grads = {name: self._transformed(name, grad, True) for name, grad in grads.items()}
        for k, group in enumerate(self.groups):
            present = [name for name in group if name in grads]
            norm_sq = sum(grads[n].norm_sq(self.norm_mode).double() for n in present) if present else None
            self.coef[k] = self._clipping_factors(k, norm_sq, batch_size)
            for name in present:
                self._accumulate(name, self._clipped_sum(grads[name], k))

    # ------------------------------------------------------------------ the step
    def take_sums(self) -> dict[str, torch.Tensor]:
        """The step's clipped sums by parameter (zero for a parameter no example reached); starts afresh."""
        sums = {name: self.sums.pop(name, None) for name in self.params}
        return {name: self._zeros(name) if s is None else s for name, s in sums.items()}

    def _zeros(self, name: str) -> torch.Tensor:
        """A full-shape zero sum (a sharded parameter's shape is its full one; zeros_like would shard)."""
        param = self.params[name]
        return torch.zeros(param.shape, dtype=param.dtype, device=param.device)

    def end_step(self) -> None:
        self.sums.clear()
        self.statistics.zero_()

    # ------------------------------------------------------------------ internals
    def _transformed(self, name: str, grad: PerExampleGrad, single_use: bool) -> PerExampleGrad:
        if self.transform is None:
            return grad
        if not single_use or name in self.shared:
            raise ValueError(
                f"parameter {name!r} is used more than once in a forward (a tied weight or a layer called "
                "repeatedly); coordinate-wise clipping (AdaCliP) standardises a parameter's whole "
                "per-example gradient, (sum_u g_u - a) / b, which the engine forms for single uses only. "
                "Untie or freeze it, or use a norm-based clipping method."
            )
        return self.transform(name, grad)

    def _add_norm_contribution(self, name: str, grad: PerExampleGrad) -> None:
        """``||sum_u g_u||^2 = sum_u ||g_u||^2 + 2 sum_{u<v} <g_u, g_v>`` over the uses of a parameter."""
        state = self._pass
        k = self.group_of[name]
        previous = state.arrived.setdefault(name, [])
        contribution = grad.norm_sq(self.norm_mode)
        for other in previous:
            contribution = contribution + 2 * grad.dot(other)
        state.norm_sq[k] = state.norm_sq.get(k, 0) + contribution.double()
        previous.append(grad)

    def _clipping_factors(
        self, k: int, norm_sq: torch.Tensor | None, batch_size: int, scales: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:func:`clipping_factors` from squared group norms (None: all zero), shape (b,), at the bounds
        ``C_k`` (``scales``: ``s_i C_k``); counts the unclipped examples (or sums their clipped norms) for
        adaptive thresholds (at C_k: the engine refuses adaptive thresholds with scales).

        A norm that is not finite (a gradient that overflowed, or ``inf * 0`` in a ghost norm of an example
        with huge activations) gives ``c_i = 0``, and :meth:`_clipped_sum` leaves the example out of the sum
        (0 times its values could still be NaN), which keeps the sensitivity bound; a NaN factor would turn
        the whole group's sum into NaN and tell that example's presence for certain."""
        if norm_sq is None:
            device = self.params[self.groups[k][0]].device
            norm_sq = torch.zeros(batch_size, dtype=torch.float64, device=device)
        norm = norm_sq.clamp_min(0).sqrt()
        threshold = self._bounds[k]
        if self.statistic == "norm":
            self.statistics[k] += clipped_norm_sums(norm, self.bound_factor * threshold)
        elif self.statistic == "count":
            self.statistics[k] += centred_counts(norm, threshold)
        finite = norm < math.inf  # False for inf and NaN; one comparison (isfinite is four launches)
        self.finite[k] = None if self._ask_host and bool(finite.all()) else finite
        bound = threshold if scales is None else threshold * scales.to(norm)
        return torch.where(finite, clipping_factors(norm, bound, self.function, self.stability), 0.0)

    def _clipped_sum(self, grad: PerExampleGrad, k: int) -> torch.Tensor:
        """``sum_i c_i g_i`` with group k's factors, leaving out the examples whose norm was not finite."""
        finite = self.finite[k]
        return (grad if finite is None else grad.masked(finite)).weighted_sum(self.coef[k])

    def _finish_group(self, k: int) -> None:
        state = self._pass
        self.coef[k] = self._clipping_factors(k, state.norm_sq.pop(k, None), state.batch_size, state.scales)
        for name in self.groups[k]:
            grads = state.arrived.pop(name, [])
            if not self.strategy.sums_at_norms:
                continue  # sums come from the second backward pass
            for grad in grads:
                self._accumulate(name, self._clipped_sum(grad, k))

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        value = value.to(self.params[name].dtype)
        if name in self.sums:
            self.sums[name].add_(value)
        else:
            self.sums[name] = value  # a fresh tensor from weighted_sum: owned from here on
