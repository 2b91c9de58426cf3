"""Sensitivity harness: the DP guarantee of the released statistics, checked on neighbouring data sets.

With ``noise_multiplier = 0`` the engine releases the statistics themselves. Per logical step these are

* ``S_k(D) = sum_{i in D} clip_k(g_i)``, group k's clipped sum: the optimizer receives ``p.grad = S / B``
  (B the expected batch size, public and fixed), read in an optimizer step post-hook;
* ``s_k(D) = sum_{i in D} (1[||g_{i,k}|| <= C_k] - 1/2)``, the centred count behind adaptive thresholds,
  read back from the public threshold update ``C_k' = C_k exp(-eta (s_k / B + 1/2 - q))``:
  ``s_k = B (q - 1/2 - log(C_k' / C_k) / eta)`` (with the ``automatic`` clip function, AUTO-S, no count
  is released: its thresholds are fixed, and clip_k(g) = C_k g / (||g|| + gamma));
* the model's buffers, which the engine never noises.

For add/remove neighbours D ~ D' (what the Poisson-subsampled accountant assumes), the Gaussian mechanism
is private only if

* ``||S_k(D) - S_k(D')|| <= C_k`` for every group k;
* ``||((S_k(D) - S_k(D')) / gamma_k)_k|| <= S = sqrt(sum_k C_k^2 / gamma_k^2)`` for the noise allocation
  (gamma_k = 1, C_k or C_k / sqrt(d_k); group k gets noise std ``sigma S gamma_k``): in units of the noise
  the engine adds at sigma = 1 (``noise_stds(C, d, 1, allocation)``), the shift has norm at most 1;
* ``|s_k(D) - s_k(D')| <= 1/2``;
* ``buffers(D) == buffers(D')`` (no noise: sensitivity 0).

Replacing example j of D by x is a remove then an add: D_x ~ D_{-j} ~ D, so every bound above holds
between D_{-j} and D_x, and twice it between D and D_x. Releasing the same logical batch in different
micro-batches must release the same statistics, and the released sums of D must be the brute-force
clipped sums of ``tests/oracle.per_example_grads`` at the same thresholds.

:func:`check_case` runs all of this and returns the violations found (empty: private); it accepts a
refusal (an error naming the offending module or parameter) where the case's contract allows one.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.noise import noise_stds
from tests.oracle import Batch, per_example_grads, slice_batch
from tests.sensitivity_models import SensitivityCase

Kind = Literal["remove", "huge", "zero", "scaled_input", "max_loss", "padding"]
KINDS: tuple[Kind, ...] = ("remove", "huge", "zero", "scaled_input", "max_loss", "padding")
ALLOCATIONS = ("global", "equal_budget", "weighted")
STRATEGIES = ("bk", "ghost", "instantiate")
CLIPPINGS = (("flat", None), ("per_layer", None), ("groups", 2))

HUGE = 1e6
SLACK = 1e-6  # relative slack on every bound (float64)
QUANTILE, QUANTILE_LR = 0.5, 0.3
GAMMA = 0.01  # stability constant of the automatic clip function
REFUSALS = (ValueError, RuntimeError, TypeError)


# ---------------------------------------------------------------------------------------------- neighbours
def applicable_kinds(case: SensitivityCase) -> list[Kind]:
    """The neighbour kinds this case can build (scaled inputs need float inputs, and so on)."""
    kinds: list[Kind] = ["remove", "huge", "zero"]
    if case.float_inputs:
        kinds.append("scaled_input")
    if case.class_label:
        kinds.append("max_loss")
    if case.padding:
        kinds.append("padding")
    return kinds


def without(batch: Batch, j: int) -> Batch:
    """D_{-j}: example j removed."""
    size = batch["weight"].shape[0]
    return slice_batch(batch, [i for i in range(size) if i != j])


def replaced(case: SensitivityCase, kind: Kind, j: int) -> Batch:
    """D_x: example j replaced by an adversarial x of the given kind.

    * huge: j's loss times -1e6, so its gradient is reversed and 1e6 times larger: where j was clipped,
      ``clip(g_x) = -clip(g_j)`` and D -> D_x moves the sum by exactly 2 C_k, the largest a replacement may;
    * zero: j's loss times 0 (gradient exactly 0);
    * scaled_input: j's floating-point inputs times 1e6;
    * max_loss: j's class label set to the class of largest loss under the current model;
    * padding: j replaced by a padding-only text (``case.padding``: key -> fill value).
    """
    batch = {k: v.clone() for k, v in case.batch.items()}
    if kind == "huge":
        batch["weight"][j] = -HUGE
    elif kind == "zero":
        batch["weight"][j] = 0.0
    elif kind == "scaled_input":
        for key in case.float_inputs:
            batch[key][j] *= HUGE
    elif kind == "max_loss":
        key, classes = case.class_label
        example = slice_batch(batch, [j])
        losses = []
        model = copy.deepcopy(case.model)
        with torch.no_grad():
            for label in range(classes):
                example[key] = torch.tensor([label])
                losses.append(float(case.loss_fn(model, example)))
        batch[key][j] = max(range(classes), key=losses.__getitem__)
    elif kind == "padding":
        for key, value in case.padding.items():
            batch[key][j] = value
    else:
        raise ValueError(kind)
    return batch


# ---------------------------------------------------------------------------------------------- releases
@dataclass
class Release:
    """What one logical step releases (noise 0): clipped sums by parameter, centred counts, buffers."""

    sums: dict[str, torch.Tensor]
    counts: torch.Tensor
    buffers: dict[str, torch.Tensor]


@dataclass
class Setting:
    """Engine configuration of one test: strategy, clipping, the groups and their thresholds C_k."""

    strategy: str
    clipping: str
    groups_arg: int | None
    groups: list[list[str]] = field(default_factory=list)
    thresholds: list[float] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)  # d_k, number of coordinates of group k
    clip_function: str = "standard"  # standard (with adaptive thresholds) | automatic (AUTO-S, fixed ones)


def _engine(model, setting: Setting, size: int, thresholds: list[float] | None = None) -> PrivacyEngine:
    return PrivacyEngine(
        model,
        batch_size=size,
        sample_size=10 * size,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        clipping=setting.clipping,
        groups=setting.groups_arg,
        strategy=setting.strategy,
        thresholds=thresholds,
        adaptive=None if automatic(setting) else {"target_quantile": QUANTILE, "quantile_lr": QUANTILE_LR},
        clip_function=setting.clip_function,
        automatic_stability=GAMMA,
    )


def automatic(setting: Setting) -> bool:
    return setting.clip_function == "automatic"


def release(case: SensitivityCase, setting: Setting, batch: Batch, micro_batches: list[list[int]]) -> Release:
    """Run one logical step of the engine on ``batch`` (expected batch size B = |D|) and read its release."""
    model = copy.deepcopy(case.model)
    engine = _engine(model, setting, case.size, setting.thresholds)
    params = engine.trainable_parameters()
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    seen: dict[str, torch.Tensor] = {}

    def read_gradients(*_) -> None:  # after the engine's own post-hook; p.grad = (S + noise) / B
        seen.update({n: p.grad.detach().clone() * case.size for n, p in params.items()})

    optimizer.register_step_post_hook(read_gradients)
    for index in micro_batches:
        engine.backward(case.loss_fn(model, slice_batch(batch, index)))
    before = engine.thresholds.clone()
    optimizer.step()
    ratio = engine.thresholds.double() / before.double()
    counts = case.size * (QUANTILE - 0.5 - torch.log(ratio) / QUANTILE_LR)
    if automatic(setting):  # nothing released besides the sums: the thresholds must not have moved
        counts = torch.where(ratio == 1, 0.0, math.inf)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    engine.detach()
    return Release(seen, counts, buffers)


def configure(
    case: SensitivityCase,
    grads: list[dict[str, torch.Tensor]],
    strategy: str,
    clipping: str,
    groups: int | None,
    clip_function: str = "standard",
) -> Setting:
    """The engine's groups for this clipping, and thresholds C_k between the two middle per-example group
    norms of D (``grads``: the oracle's; about half the examples clipped in every group, none exactly at
    its threshold)."""
    setting = Setting(strategy, clipping, groups, clip_function=clip_function)
    probe = _engine(copy.deepcopy(case.model), setting, case.size)
    setting.groups = [list(g) for g in probe.groups]
    params = probe.trainable_parameters()
    setting.dims = [sum(params[n].numel() for n in g) for g in setting.groups]
    probe.detach()
    norms = group_norms(grads, setting.groups).sort(0).values
    middle = (norms.shape[0] - 1) // 2
    thresholds = (norms[middle] + norms[middle + 1]) / 2
    setting.thresholds = thresholds.clamp_min(1e-3).tolist()
    return setting


# ---------------------------------------------------------------------------------------------- oracle
def oracle_grads(case: SensitivityCase) -> list[dict[str, torch.Tensor]]:
    """g_i for every example of D, by running each alone through a copy of the model without the engine."""
    return per_example_grads(copy.deepcopy(case.model), case.loss_fn, case.batch)


def group_norms(grads: list[dict[str, torch.Tensor]], groups: list[list[str]]) -> torch.Tensor:
    """||g_{i,k}||, shape (b, K)."""
    return torch.stack([torch.stack([_norm([g[n] for n in group]) for group in groups]) for g in grads])


def oracle_release(grads: list[dict[str, torch.Tensor]], setting: Setting) -> Release:
    """The clipped sums and centred counts of D by definition (buffers: not modelled, left empty)."""
    sums = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    counts = torch.zeros(len(setting.groups), dtype=torch.float64)
    for g in grads:
        for k, (group, threshold) in enumerate(zip(setting.groups, setting.thresholds, strict=True)):
            norm = float(_norm([g[n] for n in group]))
            if automatic(setting):
                for n in group:
                    sums[n] += g[n] * threshold / (norm + GAMMA)
                continue
            counts[k] += (norm <= threshold) - 0.5
            for n in group:
                sums[n] += g[n] * min(1.0, threshold / norm) if norm > 0 else g[n]
    return Release(sums, counts, {})


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().pow(2).sum() for t in tensors]).sum().sqrt()


# ---------------------------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class Violation:
    """A bound that failed: the statistic moved by ``moved`` units of its one-step bound (C_k, S, 1/2 or
    0 for buffers) where ``allowed`` units were allowed (the number of add/remove steps apart)."""

    pair: str
    statistic: str
    moved: float
    allowed: float

    def __str__(self) -> str:
        return f"{self.pair}: {self.statistic} moved by {self.moved:.3g} (allowed {self.allowed:g})"


def group_shifts(a: Release, b: Release, groups: list[list[str]]) -> torch.Tensor:
    """``||S_k(a) - S_k(b)||`` for every group k, shape (K,)."""
    return torch.stack([_norm([a.sums[n] - b.sums[n] for n in group]) for group in groups])


def compare(
    a: Release, b: Release, setting: Setting, pair: str, distance: int, slack: float = SLACK
) -> list[Violation]:
    """Violations of the sensitivity bounds between two releases ``distance`` add/remove steps apart
    (1: neighbours; 2: one example replaced; 0: the same data set, e.g. micro-batched differently, where
    only rounding, ``slack`` of a bound, is allowed)."""
    allowed = distance * (1 + slack) if distance else slack
    thresholds = torch.tensor(setting.thresholds, dtype=torch.float64)
    shifts = group_shifts(a, b, setting.groups)
    out: list[Violation] = []
    for k, moved in enumerate((shifts / thresholds).tolist()):
        if not moved <= allowed:  # NaN moves too
            out.append(Violation(pair, f"clipped sum of group {_label(setting, k)} / C_k", moved, distance))
    dims = torch.tensor(setting.dims, dtype=torch.float64)
    for allocation in ALLOCATIONS:
        unit = noise_stds(thresholds, dims, 1.0, allocation)  # sigma = 1: std_k = S gamma_k
        moved = float((shifts / unit).norm())
        if not moved <= allowed:  # NaN moves too
            out.append(Violation(pair, f"sum vector / S ({allocation} allocation)", moved, distance))
    for k, moved in enumerate(((a.counts - b.counts).abs() / 0.5).tolist()):
        if not moved <= allowed:  # NaN moves too
            out.append(
                Violation(pair, f"centred count of group {_label(setting, k)} / (1/2)", moved, distance)
            )
    for name, value in a.buffers.items():
        other = b.buffers.get(name)
        if other is not None and not torch.equal(value, other):
            out.append(Violation(pair, f"buffer {name} (no noise: bound 0)", math.inf, 0))
    return out


def _label(setting: Setting, k: int) -> str:
    group = setting.groups[k]
    return f"{k} ({group[0]}{f' +{len(group) - 1}' if len(group) > 1 else ''})"


# ---------------------------------------------------------------------------------------------- contract
@dataclass
class Outcome:
    """Result of :func:`check_case`: releases by data set name, refusals (messages), violations."""

    releases: dict[str, Release] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return bool(self.refusals)


def _attempt(case: SensitivityCase, outcome: Outcome, name: str, fn):
    """Run ``fn``; where the contract allows it, a refusal naming an offender is recorded instead."""
    if case.expect == "private":
        return fn()
    try:
        return fn()
    except REFUSALS as error:
        message = str(error)
        if not any(re.search(rf"(?<![\w]){re.escape(o)}(?![\w])", message) for o in case.offenders):
            raise AssertionError(
                f"{case.name}: the engine raised {type(error).__name__} on {name}, but its message does not "
                f"name the offending module or parameter {case.offenders}: {message}"
            ) from error
        outcome.refusals[name] = f"{type(error).__name__}: {message}"
        return None


def check_case(
    case: SensitivityCase,
    strategy: str,
    clipping: str,
    groups: int | None = None,
    kinds: list[Kind] | None = None,
    j: int = 1,
    clip_function: str = "standard",
) -> Outcome:
    """Release D, D split in two micro-batches, D_{-j} and D_x for every adversarial kind; compare each
    pair that was released (see the module docstring) and D against the oracle.

    A case with ``expect="refuse_or_private"`` may refuse any of these runs (or the configuration itself)
    with an error naming one of ``case.offenders``; the runs that were not refused must still be private.
    """
    outcome = Outcome()
    grads = oracle_grads(case)
    setting = _attempt(
        case,
        outcome,
        "configuration",
        lambda: configure(case, grads, strategy, clipping, groups, clip_function),
    )
    if setting is None:
        return outcome
    size = case.size
    half = size // 2
    datasets = {
        "D": (case.batch, [list(range(size))]),
        "D in 2 micro-batches": (case.batch, [list(range(half)), list(range(half, size))]),
        "D-j": (without(case.batch, j), [list(range(size - 1))]),
    }
    for kind in kinds if kinds is not None else applicable_kinds(case):
        if kind != "remove":
            datasets[f"D_x ({kind})"] = (replaced(case, kind, j), [list(range(size))])
    for name, (batch, micro) in datasets.items():
        result = _attempt(case, outcome, name, lambda b=batch, m=micro: release(case, setting, b, m))
        if result is not None:
            outcome.releases[name] = result

    oracle = oracle_release(grads, setting)
    pairs = [("D", "D in 2 micro-batches", 0), ("D", "oracle", 0), ("D in 2 micro-batches", "oracle", 0)]
    pairs.append(("D-j", "D", 1))
    for name in datasets:
        if name.startswith("D_x"):
            pairs += [("D-j", name, 1), ("D", name, 2)]
    releases = {**outcome.releases, "oracle": oracle}
    for a, b, distance in pairs:
        if a in releases and b in releases:
            slack = case.oracle_slack if "oracle" in (a, b) and case.oracle_slack else SLACK
            outcome.violations += compare(releases[a], releases[b], setting, f"{a} vs {b}", distance, slack)
    return outcome


def assert_refuses_or_private(outcome: Outcome, case: SensitivityCase) -> None:
    """The contract: no violation among the released statistics (refusals allowed only where the case's
    contract allows them, which :func:`check_case` has already enforced)."""
    if outcome.violations:
        # sensitivity breaches first (largest multiple of their bound), then inexact releases
        ordered = sorted(outcome.violations, key=lambda v: (v.allowed == 0, -v.moved / max(v.allowed, 1)))
        lines = "\n  ".join(str(v) for v in ordered[:20])
        raise AssertionError(f"{case.name}: {len(outcome.violations)} sensitivity violations:\n  {lines}")
