"""ADADP (Koskela & Honkela 2020; Monir et al. 2024 sec. 3.3): the one-step / two-half-steps update against a
hand computation, acceptance and rejection, the step-size factor, state across a checkpoint, and the trainer
accounting both releases of every iteration."""

from __future__ import annotations

import math

import pytest
import torch

from dpexp.config import ConfigError
from dpexp.privacy import accounting
from dpexp.training.adadp import ADADP
from dpexp.training.loop import run_training
from dpexp.training.optim import build_optimizer
from tests.conftest import TINY_RUN


def _iteration(theta0, g1, g2, lr=0.5, tolerance=1.0, **kwargs):
    p = torch.nn.Parameter(theta0.clone())
    opt = ADADP([p], lr=lr, tolerance=tolerance, **kwargs)
    p.grad = g1.clone()
    opt.step()
    half = p.detach().clone()
    p.grad = g2.clone()
    opt.step()
    return p.detach(), half, opt.param_groups[0]


def test_one_iteration_against_a_hand_computation():
    theta0 = torch.tensor([2.0, -0.5, 0.1])
    g1, g2 = torch.tensor([1.0, 0.0, -2.0]), torch.tensor([0.5, 1.0, -1.0])
    lr, tolerance = 0.5, 1.0
    theta, half, group = _iteration(theta0, g1, g2, lr, tolerance)
    assert torch.allclose(half, theta0 - lr / 2 * g1)
    theta_hat = half - lr / 2 * g2
    theta_1 = theta0 - lr * g1
    err = float(((theta_1 - theta_hat) / theta_1.abs().clamp_min(1.0)).norm())
    assert err <= tolerance and torch.allclose(theta, theta_hat)  # accepted: the two half steps
    assert group["lr_scale"] == pytest.approx(min(max(tolerance / err, 0.9), 1.1))
    assert group["iterations"] == 1 and group["accepted"] == 1


def test_a_large_error_discards_the_iteration_and_shrinks_the_step():
    theta0 = torch.tensor([0.3, -0.2])
    theta, _, group = _iteration(theta0, torch.tensor([1.0, 1.0]), torch.tensor([-5.0, 4.0]), tolerance=0.01)
    assert torch.equal(theta, theta0)
    assert group["lr_scale"] == pytest.approx(0.9) and group["accepted"] == 0


def test_equal_gradients_have_no_error_and_grow_the_step():
    g = torch.tensor([0.2, -0.1])
    theta, _, group = _iteration(torch.zeros(2), g, g)
    assert torch.allclose(theta, -0.5 * g) and group["lr_scale"] == pytest.approx(1.1)


def test_the_scale_multiplies_the_scheduled_lr_and_survives_a_checkpoint():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = ADADP([p], lr=0.5, tolerance=1e-6)
    for g in (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])):
        p.grad = g
        opt.step()
    state = opt.state_dict()  # mid-iteration: theta_0 and G_1 are kept
    q = torch.nn.Parameter(p.detach().clone())
    again = ADADP([q], lr=0.5, tolerance=1e-6)
    again.load_state_dict(state)
    assert again.param_groups[0]["lr_scale"] == pytest.approx(0.9)
    for opt_, param in ((opt, p), (again, q)):
        param.grad = torch.tensor([0.3, 0.3])
        opt_.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"tolerance": 0.0}, "optim.tolerance"), ({"alpha_min": 1.2}, "optim.alpha_min")],
)
def test_bad_adadp_keys_are_refused(overrides, message):
    cfg = {"name": "adadp", "lr": 0.1, "tolerance": 0.1, "alpha_min": 0.9, "alpha_max": 1.1} | overrides
    with pytest.raises(ConfigError, match=message):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg)


def test_trainer_accounts_both_releases_of_every_iteration(compose_config, tmp_path):
    record = run_training(compose_config([*TINY_RUN, "steps=4", "optim=adadp"]), tmp_path)
    assert record["status"] == "completed" and record["steps_accounted"] == 4
    assert record["adadp"]["iterations"] == 2
    want = accounting.get_epsilon(record["noise_multiplier"], record["sample_rate"], 4, record["delta"])
    assert record["epsilon"]["rdp"] == pytest.approx(want)
    assert math.isfinite(record["loss"])
