"""Individualized privacy, IDP-SGD (Boenisch et al. 2023, "Have it your way: individualized privacy assignment
for DP-SGD"; reviewed in Monir et al. 2024, section 5 and section 6.2, Tables 9-10).

Every training example i belongs to a privacy group g(i) with its own budget (epsilon_g, delta). Two
variants of DP-SGD give each group exactly its budget (the steps, delta and the base bound C are shared):

* ``sampling``: one noise multiplier sigma for everyone; example i joins a step with its group's Poisson
  rate q_g. sigma and the q_g are solved jointly: for a given sigma, q_g(sigma) is the largest rate with
  ``epsilon(sigma, q_g, T) <= epsilon_g``, and sigma is the one whose expected batch size
  ``sum_g N_g q_g(sigma)`` is the configured B (Boenisch et al., Algorithm "getSampleRate"/sigma search; the
  survey's sec. 5: they start from the sigma of the strictest group and lower it until the weighted mean
  rate is q = B/N; here the same root is found by false position between the sigmas of the strictest and
  the loosest group). The sum is still divided by B.
* ``scaling``: one rate q = B/N; example i is clipped to ``s_{g(i)} C_k`` in every parameter group k and
  the noise stays ``sigma_scale C_k`` (for the engine's noise allocation: ``noise_stds`` of the base
  thresholds), so group g's effective noise multiplier is ``sigma_g = sigma_scale / s_g``. Each sigma_g is
  solved for epsilon_g at (q, T) and ``sigma_scale`` makes the group-size-weighted mean scale 1,
  ``sum_g N_g s_g = N`` (Boenisch et al.: the mean clipping bound stays C), i.e.
  ``sigma_scale = N / sum_g (N_g / sigma_g)``.

Both variants are accounted per group by the same computation: group g's steps are Poisson-subsampled
Gaussian steps at rate ``q_g`` and noise multipliers ``sigma_t / s_g``
(:meth:`IndividualPrivacy.group_epsilon`), with any accountant and any noise schedule. A single epsilon
for the run is the largest group's (the guarantee that holds for every example); the engine and the
trainer report every group's.

Group sizes N_g enter the calibration (the paper's too): like the paper, the assignment of examples to
privacy groups is taken as public.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dpexp.privacy import accounting

Variant = Literal["sampling", "scaling"]
VARIANTS: tuple[str, ...] = ("sampling", "scaling")


@dataclass(frozen=True)
class IndividualPrivacy:
    """What the engine needs of an individualized run: per group, its Poisson rate q_g and its clipping
    scale s_g (``sampling``: s_g = 1; ``scaling``: q_g = q for all g)."""

    variant: Variant
    sample_rates: tuple[float, ...]
    scales: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(
                f"unknown individual privacy variant {self.variant!r}; valid: {', '.join(VARIANTS)}"
            )
        if not self.sample_rates or len(self.sample_rates) != len(self.scales):
            raise ValueError(
                f"individual privacy needs one sample rate and one scale per group, got "
                f"{len(self.sample_rates)} rates and {len(self.scales)} scales"
            )
        if not all(0 < q <= 1 for q in self.sample_rates):
            raise ValueError(f"every group's sample rate must be in (0, 1], got {self.sample_rates}")
        if not all(0 < s < math.inf for s in self.scales):
            raise ValueError(f"every group's clipping scale must be finite and > 0, got {self.scales}")
        if self.variant == "sampling" and any(s != 1 for s in self.scales):
            raise ValueError("the sampling variant clips every group at the base bound (scales of 1)")
        if self.variant == "scaling" and len(set(self.sample_rates)) != 1:
            raise ValueError("the scaling variant samples every group at one rate q")

    @property
    def num_groups(self) -> int:
        return len(self.scales)

    def group_noise_multipliers(self, sigmas: Sequence[float], group: int) -> list[float]:
        """Group g's effective noise multiplier at every step: ``sigma_t / s_g``."""
        return [sigma / self.scales[group] for sigma in sigmas]

    def group_epsilon(
        self, sigmas: Sequence[float], delta: float, accountant: str, group: int, repeat: int = 1
    ) -> float:
        """Epsilon spent by group g after steps at noise multipliers ``sigmas`` (each ``repeat`` times)."""
        return accounting.get_schedule_epsilon(
            self.group_noise_multipliers(sigmas, group), self.sample_rates[group], delta, accountant, repeat
        )

    def example_scales(self, groups: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``s_{g(i)}`` for every example of a batch, shape (b,), from its group indices ``groups`` (b,)."""
        check_group_indices(groups, self.num_groups)
        return torch.tensor(self.scales, dtype=dtype, device=groups.device)[groups]


def check_group_indices(groups: torch.Tensor, num_groups: int) -> None:
    """Refuse group indices that are not a 1-D integer tensor with values in [0, G)."""
    if not torch.is_tensor(groups) or groups.dim() != 1 or groups.dtype.is_floating_point:
        shape = tuple(groups.shape) if torch.is_tensor(groups) else type(groups).__name__
        raise ValueError(f"privacy_groups must be a 1-D integer tensor (one group per example), got {shape}")
    if groups.numel() and not (int(groups.min()) >= 0 and int(groups.max()) < num_groups):
        raise ValueError(
            f"privacy_groups must lie in [0, {num_groups}), got [{int(groups.min())}, {int(groups.max())}]"
        )


# ---------------------------------------------------------------------------------------------- groups
def assign_by_fractions(sample_size: int, fractions: Sequence[float], seed: int) -> torch.Tensor:
    """Group indices (N,) from group fractions (the survey's Table 9: 34/43/23 %): a seeded random split
    with ``round`` group sizes, the remainder going to the largest fractions (sizes sum to N)."""
    if not fractions or any(not (0 < f <= 1) for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"fractions must be numbers in (0, 1] that sum to 1, got {list(fractions)}")
    sizes = [math.floor(f * sample_size) for f in fractions]
    by_remainder = sorted(
        range(len(fractions)), key=lambda g: fractions[g] * sample_size - sizes[g], reverse=True
    )
    for g in by_remainder[: sample_size - sum(sizes)]:
        sizes[g] += 1
    labels = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    order = torch.randperm(sample_size, generator=torch.Generator().manual_seed(seed))
    return labels[order]


def group_sizes(groups: torch.Tensor, num_groups: int) -> list[int]:
    """N_g of every group from the group indices (N,)."""
    check_group_indices(groups, num_groups)
    return torch.bincount(groups, minlength=num_groups).tolist()


# ---------------------------------------------------------------------------------------------- calibration
def calibrate_scaling(
    epsilons: Sequence[float],
    sizes: Sequence[int],
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    shape: Sequence[float] | None = None,
    solve: Callable[..., float] = accounting.get_noise_multiplier,
    **solve_kwargs: object,
) -> tuple[float, IndividualPrivacy]:
    """(sigma_scale, the plan) of the scaling variant: sigma_g solved for epsilon_g at (q, T) with ``solve``
    (never above the budget), ``sigma_scale = N / sum_g N_g / sigma_g``, ``s_g = sigma_scale / sigma_g``.
    With a noise schedule's ``shape`` the sigma_g are the schedules' scales (first sigmas)."""
    _check_groups(epsilons, sizes)
    group_sigmas = []
    for g, epsilon in enumerate(epsilons):
        kwargs = dict(solve_kwargs, **({} if shape is None else {"shape": shape}))
        group_sigmas.append(_solve_group(solve, g, epsilon, delta, sample_rate, steps, accountant, kwargs))
    sigma = sum(sizes) / sum(n / s for n, s in zip(sizes, group_sigmas, strict=True))
    scales = tuple(sigma / s for s in group_sigmas)
    return sigma, IndividualPrivacy("scaling", (sample_rate,) * len(epsilons), scales)


def calibrate_sampling(
    epsilons: Sequence[float],
    sizes: Sequence[int],
    delta: float,
    batch_size: int,
    steps: int,
    accountant: str = "rdp",
    shape: Sequence[float] | None = None,
    solve: Callable[..., float] = accounting.get_noise_multiplier,
    tolerance: float = 1e-3,
    **solve_kwargs: object,
) -> tuple[float, IndividualPrivacy]:
    """(sigma, the plan) of the sampling variant: sigma such that ``sum_g N_g q_g(sigma)`` is B within
    ``tolerance`` (at or just above B), each q_g(sigma) the largest rate whose epsilon stays within
    (1 - tolerance) epsilon_g and epsilon_g under ``accountant`` (rate 1 when even that is within it).

    sigma lies between the sigma of the loosest group at q = B/N (there every q_g <= q: the expected batch
    is at most B) and that of the strictest group (every q_g >= q: at least B); it is found by false
    position in log sigma (:func:`dpexp.privacy.accounting.false_position`)."""
    _check_groups(epsilons, sizes)
    n = sum(sizes)
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be in [1, N={n}], got {batch_size}")
    shape = [1.0] if shape is None else list(shape)
    repeat = steps // len(shape)
    kwargs = dict(solve_kwargs, **({} if len(shape) == 1 else {"shape": shape}))
    q = batch_size / n
    bounds = [
        _solve_group(solve, g, epsilons[g], delta, q, steps, accountant, kwargs)
        for g in (
            max(range(len(epsilons)), key=epsilons.__getitem__),
            min(range(len(epsilons)), key=epsilons.__getitem__),
        )
    ]
    rates: dict[float, list[float]] = {}

    def rates_at(sigma: float) -> list[float]:
        if sigma not in rates:
            rates[sigma] = [
                _largest_rate([sigma * f for f in shape], repeat, epsilon, delta, accountant, tolerance)
                for epsilon in epsilons
            ]
        return rates[sigma]

    def shortfall(
        sigma: float,
    ) -> float:  # relative shortfall of the expected batch size, decreasing in sigma
        return 1 - sum(m * r for m, r in zip(sizes, rates_at(sigma), strict=True)) / batch_size

    lo, hi = bounds
    f_lo, f_hi = shortfall(lo), shortfall(hi)
    while f_hi > 0:  # the strictest group's rate solved just below q (the solvers' tolerance)
        hi *= 1 + tolerance
        f_hi = shortfall(hi)
    # f_lo <= 0: all budgets equal, or the rates solved just above q
    sigma = lo if f_lo <= 0 else accounting.false_position(shortfall, lo, f_lo, hi, f_hi, tolerance)
    return sigma, IndividualPrivacy("sampling", tuple(rates_at(sigma)), (1.0,) * len(epsilons))


def _largest_rate(
    sigmas: list[float], repeat: int, epsilon: float, delta: float, accountant: str, tolerance: float
) -> float:
    """The largest q in (0, 1] with epsilon(sigmas, q) <= epsilon, within (1 - tolerance) of it: false
    position on u = 1/q (epsilon decreases in u) with the accountants' solver."""

    def excess(u: float) -> float:
        return accounting.get_schedule_epsilon(sigmas, 1 / u, delta, accountant, repeat) / epsilon - 1

    f_one = excess(1.0)
    if f_one <= 0:
        return 1.0
    lo, f_lo, hi = 1.0, f_one, 2.0
    f_hi = excess(hi)
    while f_hi > 0:
        lo, f_lo, hi = hi, f_hi, hi * 4
        if hi > 1e12:
            raise ValueError(
                f"no sample rate above 1e-12 keeps epsilon={epsilon} at noise multiplier {sigmas[0]}"
            )
        f_hi = excess(hi)
    return 1 / accounting.false_position(excess, lo, f_lo, hi, f_hi, tolerance)


def _solve_group(
    solve: Callable[..., float],
    group: int,
    epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    kwargs: dict[str, object],
) -> float:
    try:
        return solve(epsilon, delta, sample_rate, steps, accountant=accountant, **kwargs)
    except ValueError as error:
        raise ValueError(
            f"privacy group {group} (epsilon={epsilon}) cannot meet its budget: {error}"
        ) from None


def _check_groups(epsilons: Sequence[float], sizes: Sequence[int]) -> None:
    if not epsilons or len(epsilons) != len(sizes):
        raise ValueError(f"need one epsilon per privacy group: {len(epsilons)} epsilons, {len(sizes)} groups")
    bad = [e for e in epsilons if not (e > 0 and math.isfinite(e))]
    if bad:
        raise ValueError(f"every group's epsilon must be a finite number > 0, got {list(epsilons)}")
    empty = [g for g, n in enumerate(sizes) if n < 1]
    if empty:
        raise ValueError(f"privacy groups {empty} have no training example: every group needs at least one")


def calibrate(
    variant: Variant,
    epsilons: Sequence[float],
    sizes: Sequence[int],
    delta: float,
    batch_size: int,
    steps: int,
    accountant: str = "rdp",
    shape: Sequence[float] | None = None,
    **solve_kwargs: object,
) -> tuple[float, IndividualPrivacy]:
    """(sigma, the plan) of either variant for expected batch size B over the N = sum_g N_g examples:
    :func:`calibrate_sampling`, or :func:`calibrate_scaling` at q = B/N."""
    if variant == "sampling":
        args = (epsilons, sizes, delta, batch_size, steps, accountant, shape)
        return calibrate_sampling(*args, **solve_kwargs)
    if variant == "scaling":
        rate = batch_size / sum(sizes)
        return calibrate_scaling(epsilons, sizes, delta, rate, steps, accountant, shape, **solve_kwargs)
    raise ValueError(f"unknown individual privacy variant {variant!r}; valid: {', '.join(VARIANTS)}")
