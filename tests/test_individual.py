"""Individualized privacy (IDP-SGD, Boenisch et al. 2023): calibration of both variants against independent
accountants (Opacus' RDP accountant, prv_accountant), the scaling variant's clipped sums against the
brute-force oracle in every strategy and clipping mode, one example of group g moving each released group sum
by at most s_g C_k, the per-example Poisson sampler, and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.clipping import clipping_factors
from dpexp.privacy.individual import (
    IndividualPrivacy,
    assign_by_fractions,
    calibrate_sampling,
    calibrate_scaling,
    group_sizes,
)
from dpexp.training.sampling import PoissonBatchSampler
from tests.engine_models import make_case
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads, slice_batch
from tests.test_engine_oracle import _groups_of

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")

# the survey's Table 9, case 1 (Boenisch et al.'s setting), on the digits training set
EPSILONS = [1.0, 2.0, 3.0]
FRACTIONS = [0.34, 0.43, 0.23]
N, B, T = 1437, 128, 225
DELTA = 1 / (2 * N)


@pytest.fixture(scope="module")
def sizes():
    return group_sizes(assign_by_fractions(N, FRACTIONS, seed=0), 3)


# ---------------------------------------------------------------------------------------------- groups
def test_fractions_give_seeded_groups_of_the_right_sizes():
    groups = assign_by_fractions(N, FRACTIONS, seed=0)
    assert group_sizes(groups, 3) == [489, 618, 330]  # round(0.34 N) etc., summing to N
    assert torch.equal(groups, assign_by_fractions(N, FRACTIONS, seed=0))
    assert not torch.equal(groups, assign_by_fractions(N, FRACTIONS, seed=1))
    assert groups[:200].unique().numel() == 3  # shuffled, not blocks
    with pytest.raises(ValueError, match="sum to 1"):
        assign_by_fractions(N, [0.5, 0.4], seed=0)


# ---------------------------------------------------------------------------------------------- accounting
def _opacus_rdp_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from dpexp.privacy.accounting.rdp import RDP_ORDERS

    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(RDP_ORDERS))
    assert RDPAccountant  # the accountant's own analysis functions, with our order grid
    return get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)[0]


def test_scaling_meets_every_budget_under_opacus_rdp(sizes):
    sigma, plan = calibrate_scaling(EPSILONS, sizes, DELTA, B / N, T)
    assert plan.scales[0] < 1 < plan.scales[2]  # the strict group clipped lower, the loose one higher
    assert math.isclose(sum(n * s for n, s in zip(sizes, plan.scales, strict=True)), N, rel_tol=1e-9)
    for g, epsilon in enumerate(EPSILONS):
        independent = _opacus_rdp_epsilon(sigma / plan.scales[g], B / N, T, DELTA)
        assert 0.998 * epsilon <= independent <= epsilon * (1 + 1e-9), (g, independent)
        ours = plan.group_epsilon([sigma], DELTA, "rdp", g, repeat=T)
        assert math.isclose(ours, independent, rel_tol=1e-6)


def test_sampling_meets_every_budget_under_opacus_rdp_at_batch_size_b(sizes):
    sigma, plan = calibrate_sampling(EPSILONS, sizes, DELTA, B, T)
    rates = plan.sample_rates
    assert rates[0] < B / N < rates[2] and plan.scales == (1.0, 1.0, 1.0)
    expected_batch = sum(n * q for n, q in zip(sizes, rates, strict=True))
    assert B <= expected_batch <= B * 1.001
    for g, epsilon in enumerate(EPSILONS):
        independent = _opacus_rdp_epsilon(sigma, rates[g], T, DELTA)
        assert 0.998 * epsilon <= independent <= epsilon * (1 + 1e-9), (g, independent)
    # sigma lies between the uniform sigmas of the loosest and the strictest budget (the paper's search)
    from dpexp.privacy.accounting import get_noise_multiplier

    assert get_noise_multiplier(3.0, DELTA, B / N, T) < sigma < get_noise_multiplier(1.0, DELTA, B / N, T)


@pytest.mark.slow
def test_group_epsilons_match_prv_accountant_directly(sizes):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    sigma, plan = calibrate_scaling(EPSILONS, sizes, DELTA, B / N, T)
    for g in range(3):
        prv = PoissonSubsampledGaussianMechanism(
            noise_multiplier=sigma / plan.scales[g], sampling_probability=B / N
        )
        accountant = PRVAccountant(
            prvs=[prv], max_self_compositions=[T], eps_error=0.01, delta_error=DELTA / 1000
        )
        _, _, upper = accountant.compute_epsilon(delta=DELTA, num_self_compositions=[T])
        assert math.isclose(plan.group_epsilon([sigma], DELTA, "prv", g, repeat=T), upper, rel_tol=1e-6)
        assert upper <= EPSILONS[g]  # PRV is tighter than the RDP bound that calibrated


def test_a_noise_schedule_is_accounted_per_group(sizes):
    shape = [1.0] * 100 + [0.8] * 125
    sigma, plan = calibrate_scaling(EPSILONS, sizes, DELTA, B / N, T, shape=shape)
    for g, epsilon in enumerate(EPSILONS):
        spent = plan.group_epsilon([sigma * f for f in shape], DELTA, "rdp", g)
        assert 0.998 * epsilon <= spent <= epsilon


def test_unmeetable_budgets_are_refused(sizes):
    with pytest.raises(ValueError, match=r"privacy group 0 \(epsilon=1e-06\) cannot meet its budget"):
        calibrate_scaling([1e-6, 2.0, 3.0], sizes, DELTA, B / N, T)
    with pytest.raises(ValueError, match="finite number > 0"):
        calibrate_sampling([0.0, 2.0, 3.0], sizes, DELTA, B, T)
    with pytest.raises(ValueError, match=r"privacy groups \[1\] have no training example"):
        calibrate_scaling(EPSILONS, [10, 0, 5], DELTA, 0.1, T)
    with pytest.raises(ValueError, match="one epsilon per privacy group"):
        calibrate_sampling([1.0, 2.0], sizes, DELTA, B, T)


# ---------------------------------------------------------------------------------------------- clipping
def test_factors_with_per_example_bounds():
    norm = torch.tensor([0.0, 0.5, 2.0, 8.0], dtype=torch.float64)
    bound = torch.tensor([1.0, 0.25, 4.0, 2.0], dtype=torch.float64)
    assert torch.allclose(
        clipping_factors(norm, bound), torch.tensor([1.0, 0.5, 1.0, 0.25], dtype=torch.float64)
    )
    assert bool((clipping_factors(norm, bound, "automatic") * norm < bound).all())


def _scaling(num_groups: int = 3) -> IndividualPrivacy:
    return IndividualPrivacy("scaling", (0.1,) * num_groups, tuple(0.3 + 0.6 * g for g in range(num_groups)))


@pytest.mark.parametrize("case", ["mlp", "wrn_block", "gpt2"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping,groups", [("flat", None), ("per_layer", None), ("groups", 2)])
def test_scaling_clipped_sums_match_the_oracle(case, strategy, clipping, groups):
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    grads = per_example_grads(model, loss_fn, batch)
    partition = _groups_of(model, clipping, groups)
    norms = group_norms(grads, partition)
    # thresholds around the median norm so that every group has clipped and unclipped examples
    thresholds = [float(norms[:, k].median()) for k in range(len(partition))]
    individual = _scaling()
    privacy_groups = torch.arange(size) % 3
    scales = [individual.scales[g] for g in privacy_groups.tolist()]
    micro = [[0, 1, 2], [3, 4, 5]] if size == 6 else [list(range(size))]
    for function, gamma in (("standard", None), ("automatic", 0.01)):
        expected = clipped_mean(grads, partition, thresholds, size, automatic_stability=gamma, scales=scales)
        delta, _ = engine_update(
            model, loss_fn, batch, micro, batch_size=size, privacy_groups=privacy_groups, clipping=clipping,
            groups=groups, strategy=strategy, thresholds=thresholds, max_grad_norm=1.0, individual=individual,
            clip_function=function,
        )  # fmt: skip
        for name, want in expected.items():
            err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
            assert err < 1e-5, f"{case}/{strategy}/{clipping}/{function}: {name} relative error {err:.2e}"
    # the scales matter: the unscaled sum differs
    unscaled = clipped_mean(grads, partition, thresholds, size)
    assert any((unscaled[n] - expected[n]).norm() > 1e-6 * expected[n].norm() for n in expected)


@pytest.mark.parametrize("case", ["mlp", pytest.param("gpt2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping,groups", [("flat", None), ("per_layer", None), ("groups", 2)])
def test_one_example_moves_each_group_sum_by_at_most_its_own_bound(case, strategy, clipping, groups):
    """Removing example j (group g) moves group k of the released sum by at most s_g C_k (noise 0), reached
    exactly by an example clipped to its bound; an input scaled by 1e6 in its place (float inputs) moves it
    by at most s_g C_k from the data set without it."""
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    partition = _groups_of(model, clipping, groups)
    norms = group_norms(per_example_grads(model, loss_fn, batch), partition)
    assert bool((norms > 0).all())
    individual = _scaling()
    # below every norm at every scale: every example is clipped to exactly its own bound
    thresholds = [0.5 * float(norms[:, k].min()) / max(individual.scales) for k in range(len(partition))]
    privacy_groups = torch.arange(size) % 3
    kwargs = {
        "clipping": clipping,
        "groups": groups,
        "strategy": strategy,
        "thresholds": thresholds,
        "max_grad_norm": 1.0,
        "individual": individual,
    }

    def released(data, groups):
        delta, _ = engine_update(model, loss_fn, data, [list(range(len(groups)))], 1, groups, **kwargs)
        return delta

    def shifts(one, other):
        return [sum(float((one[n] - other[n]).pow(2).sum()) for n in group) ** 0.5 for group in partition]

    full = released(batch, privacy_groups)
    for j in range(size):
        keep = [i for i in range(size) if i != j]
        smaller = released(slice_batch(batch, keep), privacy_groups[keep])
        bound = individual.scales[int(privacy_groups[j])]
        for k, shift in enumerate(shifts(full, smaller)):
            assert shift <= thresholds[k] * bound * (1 + 1e-6), f"example {j}, group {k}: moved {shift:.4g}"
            assert shift >= thresholds[k] * bound * (1 - 1e-6)  # clipped exactly to its own bound
        if "x" in batch and batch["x"].is_floating_point():
            huge = {name: value.clone() for name, value in batch.items()}
            huge["x"][j] *= 1e6
            for k, shift in enumerate(shifts(released(huge, privacy_groups), smaller)):
                assert shift <= thresholds[k] * bound * (1 + 1e-6), f"huge {j}, group {k}: moved {shift:.4g}"


def test_engine_accounts_every_group_and_reports_the_weakest(sizes):
    sigma, plan = calibrate_scaling(EPSILONS, sizes, DELTA, B / N, T)
    model, loss_fn, batch = make_case("mlp")
    engine = PrivacyEngine(
        model, batch_size=B, sample_size=N, max_grad_norm=1.0, noise_multiplier=sigma, individual=plan
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.get_epsilon_by_group(DELTA) == [0.0, 0.0, 0.0]
    engine.backward(loss_fn(model, batch), privacy_groups=torch.tensor([0, 1, 2, 0, 1, 2]))
    optimizer.step()
    engine.steps = T  # as if all T steps were taken
    by_group = engine.get_epsilon_by_group(DELTA)
    assert all(0.998 * e <= spent <= e for e, spent in zip(EPSILONS, by_group, strict=True))
    assert engine.get_epsilon(DELTA) == max(by_group)


def test_engine_refuses_what_it_cannot_clip_correctly():
    model, loss_fn, batch = make_case("mlp")
    common = {"batch_size": 2, "sample_size": 10, "max_grad_norm": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="adaptive thresholds release counts at C_k"):
        PrivacyEngine(model, **common, individual=_scaling(), adaptive={"target_quantile": 0.5})
    engine = PrivacyEngine(model, **common, individual=_scaling())
    with pytest.raises(ValueError, match=r"pass engine.backward.*privacy_groups"):
        engine.backward(loss_fn(model, batch))
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\)"):
        engine.backward(loss_fn(model, batch), privacy_groups=torch.full((6,), 3))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        engine.backward(loss_fn(model, batch), privacy_groups=torch.zeros(6))
    with pytest.raises(ValueError, match="2 entries for 6"):
        engine.backward(loss_fn(model, batch), privacy_groups=torch.zeros(2, dtype=torch.long))
    plain = PrivacyEngine(make_case("mlp")[0], **common)
    with pytest.raises(ValueError, match="without individual privacy"):
        plain.backward(loss_fn(plain.model, batch), privacy_groups=torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="scaling variant samples every group at one rate"):
        IndividualPrivacy("scaling", (0.1, 0.2), (1.0, 2.0))
    with pytest.raises(ValueError, match="sampling variant clips every group at the base bound"):
        IndividualPrivacy("sampling", (0.1, 0.2), (1.0, 2.0))


# ---------------------------------------------------------------------------------------------- sampling
def test_poisson_sampler_with_per_example_rates():
    rates = torch.tensor([0.05] * 500 + [0.5] * 500, dtype=torch.float64)
    sampler = PoissonBatchSampler(1000, rates, steps=400, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(1000)
    for batch in sampler:
        counts[batch] += 1
    low, high = counts[:500].mean() / 400, counts[500:].mean() / 400
    assert abs(low - 0.05) < 0.005 and abs(high - 0.5) < 0.01
    with pytest.raises(ValueError, match="one rate per example"):
        PoissonBatchSampler(10, torch.full((9,), 0.1), steps=1, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        PoissonBatchSampler(2, torch.tensor([0.1, 1.5]), steps=1, generator=torch.Generator())
