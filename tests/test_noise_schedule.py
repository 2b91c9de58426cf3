"""Noise decay (Monir et al. 2024, sec. 3.1.1): the schedules' formulas, their exact accounting against
Opacus' per-step RDP composition, prv_accountant and the GDP closed form, calibration of the scale,
budget-based stopping, the engine's noise of every step, and the trainer end to end."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
from torch import nn

from dpexp.privacy import PrivacyEngine, accounting
from dpexp.privacy.accounting.gdp import gdp_epsilon
from dpexp.privacy.accounting.prv import PRV_EPS_ERROR
from dpexp.privacy.accounting.rdp import RDP_ORDERS
from dpexp.privacy.adaptive import split_noise_multiplier
from dpexp.privacy.noise_schedule import SCHEDULES, schedule_shape
from dpexp.training.loop import run_training
from dpexp.training.plan import plan_run
from tests.conftest import TINY_RUN

Q = 0.1  # ten steps per epoch


def test_schedules_follow_the_survey_formulas():
    """sigma_t / sigma_0 at e = floor(t q) epochs completed (Monir et al. 2024, sec. 3.1.1 a-d)."""
    steps = 60
    epochs = np.floor(np.arange(steps) * Q + 1e-9)
    np.testing.assert_allclose(schedule_shape("constant", steps, Q), np.ones(steps))
    np.testing.assert_allclose(schedule_shape("time", steps, Q, rate=0.5), 1 / (1 + 0.5 * epochs))
    np.testing.assert_allclose(schedule_shape("exponential", steps, Q, rate=0.2), np.exp(-0.2 * epochs))
    np.testing.assert_allclose(
        schedule_shape("step", steps, Q, rate=0.5, period=2), 0.5 ** np.floor(epochs / 2)
    )
    poly = schedule_shape("polynomial", steps, Q, rate=2.0, period=4, end_fraction=0.25)
    want = 0.75 * (1 - np.minimum(epochs, 4) / 4) ** 2 + 0.25
    np.testing.assert_allclose(poly, want)
    assert poly[-1] == 0.25 and poly[0] == 1.0  # sigma_end after `period` epochs
    for name in SCHEDULES:  # every schedule starts at the scale and never grows
        kwargs = {"rate": 0.5, "period": 2, "end_fraction": 0.5}
        shape = np.asarray(schedule_shape(name, steps, Q, **kwargs))
        assert shape[0] == 1 and np.all(np.diff(shape) <= 0) and np.all(shape > 0)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("cosine", {}, "valid schedules"),
        ("time", {}, "noise.rate"),
        ("exponential", {"rate": -1.0}, "noise.rate"),
        ("step", {"rate": 1.5, "period": 2}, r"must be in \(0, 1\)"),
        ("step", {"rate": 0.5}, "noise.period"),
        ("polynomial", {"rate": 1.0, "period": 3, "end_fraction": 0.0}, "noise.end_fraction"),
    ],
)
def test_bad_schedules_are_refused(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        schedule_shape(name, 10, Q, **kwargs)


SIGMAS = [2.0, 2.0, 1.5, 1.5, 1.2, 1.0, 1.0, 0.9]


def test_rdp_of_a_schedule_matches_opacus_per_step_composition():
    delta = 1e-5
    opacus = RDPAccountant()
    for sigma in SIGMAS:
        opacus.step(noise_multiplier=sigma, sample_rate=Q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        want = opacus.get_epsilon(delta, alphas=list(RDP_ORDERS))
    assert accounting.get_schedule_epsilon(SIGMAS, Q, delta, "rdp") == pytest.approx(want, rel=1e-8)
    # order does not matter; a constant schedule is get_epsilon
    assert accounting.get_schedule_epsilon(SIGMAS[::-1], Q, delta) == pytest.approx(want, rel=1e-12)
    assert accounting.get_schedule_epsilon([1.3] * 7, Q, delta) == accounting.get_epsilon(1.3, Q, 7, delta)


def test_prv_of_a_schedule_matches_prv_accountant_step_by_step():
    """Ours groups equal sigmas into one PRV each; the reference composes one PRV per step."""
    delta = 1e-5
    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=Q, noise_multiplier=s) for s in SIGMAS]
    reference = PRVAccountant(
        prvs=prvs, eps_error=PRV_EPS_ERROR, delta_error=delta / 1000, max_self_compositions=[1] * len(prvs)
    )
    low, _, upper = reference.compute_epsilon(delta=delta, num_self_compositions=[1] * len(prvs))
    ours = accounting.get_schedule_epsilon(SIGMAS, Q, delta, "prv")
    assert low - 1e-9 <= ours <= upper + PRV_EPS_ERROR
    assert ours < accounting.get_schedule_epsilon(SIGMAS, Q, delta, "rdp")


def test_gdp_of_a_schedule_is_the_clt_sum():
    delta = 1e-5
    mu = Q * math.sqrt(sum(math.expm1(s**-2) for s in SIGMAS))
    assert accounting.get_schedule_epsilon(SIGMAS, Q, delta, "gdp") == pytest.approx(gdp_epsilon(mu, delta))


def test_a_zero_sigma_anywhere_is_no_privacy():
    assert accounting.get_schedule_epsilon([1.0, 0.0, 1.0], Q, 1e-5) == math.inf


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_the_scale_is_solved_for_the_budget(accountant):
    shape = schedule_shape("time", 40, Q, rate=0.5)
    scale = accounting.get_noise_multiplier(2.0, 1e-5, Q, 40, accountant=accountant, shape=shape)
    spent = accounting.get_schedule_epsilon([scale * f for f in shape], Q, 1e-5, accountant)
    assert 2.0 * (1 - 1e-3) <= spent <= 2.0
    constant = accounting.get_noise_multiplier(2.0, 1e-5, Q, 40, accountant=accountant)
    assert scale > constant  # decaying noise starts above the constant sigma of the same budget
    with pytest.raises(ValueError, match="40 positive finite factors"):
        accounting.get_noise_multiplier(2.0, 1e-5, Q, 40, shape=shape[:-1])


def test_steps_within_budget_is_where_the_budget_is_spent():
    sigmas = [2.0 * f for f in schedule_shape("exponential", 200, Q, rate=0.3)]
    stop = accounting.steps_within_budget(sigmas, Q, 1e-5, 1.0)
    assert 0 < stop < 200
    assert accounting.get_schedule_epsilon(sigmas[:stop], Q, 1e-5) <= 1.0
    assert accounting.get_schedule_epsilon(sigmas[: stop + 1], Q, 1e-5) > 1.0
    assert accounting.steps_within_budget(sigmas, Q, 1e-5, 1e-6) == 0


# ---------------------------------------------------------------------------------------------- engine
def _noise_of_each_step(noise_multiplier, adaptive=None, steps: int = 2):
    """The std of p.grad over a 20k-parameter layer whose gradients are 0 (the noise / B alone) and the
    threshold C of each step; the engine."""
    model = nn.Linear(200, 100, bias=False)
    nn.init.zeros_(model.weight)
    engine = PrivacyEngine(
        model,
        batch_size=4,
        sample_size=40,
        max_grad_norm=2.0,
        noise_multiplier=noise_multiplier,
        adaptive=adaptive,
        generator=torch.Generator().manual_seed(0),
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    stds, thresholds = [], []
    for _ in range(steps):
        thresholds.append(float(engine.thresholds[0]))
        engine.backward(model(torch.zeros(4, 200)).sum(1))
        optimizer.step()
        stds.append(float(model.weight.grad.std()))
        optimizer.zero_grad()
    return stds, thresholds, engine


def test_the_engine_adds_each_steps_sigma_and_accounts_it():
    stds, _, engine = _noise_of_each_step([3.0, 1.0])
    assert stds[0] == pytest.approx(3.0 * 2.0 / 4, rel=0.03)
    assert stds[1] == pytest.approx(1.0 * 2.0 / 4, rel=0.03)
    assert engine.get_epsilon(1e-5) == accounting.get_schedule_epsilon([3.0, 1.0], 0.1, 1e-5)
    with pytest.raises(RuntimeError, match="schedule has 2 steps"):
        engine.backward(engine.model(torch.zeros(4, 200)).sum(1))
        engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.0)).step()


def test_adaptive_thresholds_split_each_steps_sigma():
    adaptive = {"target_quantile": 0.5, "quantile_lr": 0.2, "budget_fraction": 0.1}
    stds, thresholds, _ = _noise_of_each_step([3.0, 1.5], adaptive=adaptive)
    assert thresholds[0] != thresholds[1]
    for sigma, std, threshold in zip([3.0, 1.5], stds, thresholds, strict=True):
        grad_sigma, _ = split_noise_multiplier(sigma, 1, 0.1)
        assert std == pytest.approx(grad_sigma * threshold / 4, rel=0.03)


# ---------------------------------------------------------------------------------------------- trainer
def test_plan_solves_the_schedule_and_records_every_sigma(compose_config):
    cfg = compose_config(
        ["batch_size=100", "epochs=4", "privacy.epsilon=2.0", "noise=time", "noise.rate=1.0"]
    )
    plan = plan_run(cfg, sample_size=1000)
    assert plan.noise_schedule == "time" and len(plan.noise_multipliers) == plan.steps == 40
    assert plan.noise_multipliers[0] == plan.noise_multiplier
    assert plan.noise_multipliers[10] == pytest.approx(plan.noise_multiplier / 2)  # 1 / (1 + k e), e = 1
    spent = accounting.get_schedule_epsilon(plan.noise_multipliers, 0.1, plan.delta)
    assert 2.0 * (1 - 1e-3) <= spent <= 2.0


def test_budget_based_stopping(compose_config):
    base = ["batch_size=100", "epochs=50", "privacy.epsilon=1.0", "noise=exponential", "noise.rate=0.2"]
    plan = plan_run(compose_config([*base, "noise.initial=3.0"]), sample_size=1000)
    assert plan.stopped_at_budget and 0 < plan.steps < 500 and len(plan.noise_multipliers) == plan.steps
    assert accounting.get_schedule_epsilon(plan.noise_multipliers, 0.1, plan.delta) <= 1.0
    more = [*plan.noise_multipliers, 3.0 * math.exp(-0.2 * math.floor(plan.steps * 0.1 + 1e-9))]
    assert accounting.get_schedule_epsilon(more, 0.1, plan.delta) > 1.0

    with pytest.raises(ValueError, match=r"in its first step: raise noise\.initial"):
        plan_run(compose_config([*base, "noise.initial=0.05"]), sample_size=1000)
    with pytest.raises(ValueError, match=r"does not spend privacy\.epsilon=1\.0 in the 50 steps"):
        plan_run(compose_config([*base, "noise.initial=30", "epochs=5"]), sample_size=1000)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["noise=step", "noise.rate=1.2"], "noise.rate"),
        (["noise.initial=-1"], "noise.initial must be a finite sigma"),
        (["noise=time", "clip=opacus"], "noise schedules need a dpexp clip"),
        (["noise.initial=2", "clip=nonprivate"], "adds none"),
    ],
)
def test_bad_noise_keys_are_refused_before_training(compose_config, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        run_training(compose_config([*TINY_RUN, *overrides]), tmp_path)


def test_trainer_runs_a_schedule_and_records_it(compose_config, tmp_path):
    run = [*TINY_RUN, "steps=6", "batch_size=512", "physical_batch_size=512"]  # q ~ 0.45: two epochs
    record = run_training(compose_config([*run, "noise=time", "noise.rate=0.5"]), tmp_path)
    assert record["status"] == "completed"
    assert record["noise_schedule"] == "time" and len(record["noise_multipliers"]) == record["steps"]
    assert record["noise_multipliers"][-1] < record["noise_multipliers"][0]
    spent = accounting.get_schedule_epsilon(
        record["noise_multipliers"], record["sample_rate"], record["delta"]
    )
    assert record["epsilon"]["rdp"] == pytest.approx(spent)
    assert record["epsilon"]["rdp"] <= record["target_epsilon"]
