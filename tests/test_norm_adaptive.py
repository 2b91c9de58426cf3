"""Norm-based adaptive clipping (van der Veen et al. 2018; Monir et al. 2024 sec. 3.2.1): the released
statistic against the oracle's norms on real models and every strategy, its sensitivity under removal of any
example, the threshold update, the budget split, and a training run."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.adaptive import AdaptiveConfig, split_noise_multiplier, update_thresholds_from_norms
from dpexp.training.loop import run_training
from tests.conftest import TINY_RUN
from tests.engine_models import make_case
from tests.oracle import group_norms, per_example_grads
from tests.test_engine_adaptive import TwoHeads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")
NORM = {"method": "norm", "norm_factor": 1.5, "bound_factor": 2.0, "budget_fraction": 0.1}


def _statistics(model, loss_fn, batch, micro, thresholds, strategy="bk"):
    size = next(iter(batch.values())).shape[0]
    engine = PrivacyEngine(
        copy.deepcopy(model),
        batch_size=size,
        sample_size=10 * size,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        clipping="per_layer",
        thresholds=thresholds,
        strategy=strategy,
        adaptive=NORM,
    )
    optimizer = engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.0))
    for indices in micro:
        engine.backward(loss_fn(engine.model, {k: v[indices] for k, v in batch.items()}))
    stats = engine.adaptive_statistics
    optimizer.step()
    return stats, engine.thresholds.clone(), engine


@pytest.mark.parametrize("case", ["mlp", "gpt2", "wrn_block"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_released_norm_sums_and_next_thresholds_match_the_oracle(case, strategy):
    model, loss_fn, batch = make_case(case)
    grads = per_example_grads(model, loss_fn, batch)
    partition = PrivacyEngine(
        copy.deepcopy(model),
        batch_size=6,
        sample_size=60,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        clipping="per_layer",
    ).groups
    norms = group_norms(grads, partition)  # (B, K)
    thresholds = (norms.median(0).values / 2).tolist()  # beta C_k = median: half the norms clipped at L_k
    stats, updated, _ = _statistics(model, loss_fn, batch, [[0, 1, 2], [3, 4, 5]], thresholds, strategy)
    bounds = 2.0 * torch.tensor(thresholds, dtype=torch.float64)
    want = torch.minimum(norms, bounds).sum(0)
    torch.testing.assert_close(stats.cpu(), want, rtol=1e-6, atol=1e-9)
    expected = torch.maximum(1.5 * want / 6, torch.tensor(thresholds, dtype=torch.float64) / 10)
    torch.testing.assert_close(updated.double().cpu(), expected, rtol=1e-6, atol=1e-9)


def test_removing_any_example_moves_each_norm_sum_by_at_most_its_bound():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    x[0] = 0.0  # zero gradient
    x[1] *= 1e6  # huge: clipped at L_k
    thresholds = [2.0, 2.5]
    bounds = 2.0 * torch.tensor(thresholds, dtype=torch.float64)

    def loss(model, batch):
        return model(batch["x"], batch["y"])

    model = TwoHeads()
    full, _, _ = _statistics(model, loss, {"x": x, "y": y}, [list(range(8))], thresholds)
    moved_to_bound = False
    for j in range(8):
        keep = [i for i in range(8) if i != j]
        reduced, _, _ = _statistics(model, loss, {"x": x[keep], "y": y[keep]}, [list(range(7))], thresholds)
        shift = (full - reduced).abs()
        assert torch.all(shift <= bounds + 1e-9), f"example {j}: {shift} > {bounds}"
        moved_to_bound |= bool(torch.isclose(shift, bounds).all())
    assert moved_to_bound  # the huge example moves both sums by exactly L_k: the bound is tight


def test_the_budget_split_uses_sensitivity_one_in_units_of_the_bound():
    sigma, k, r = 1.3, 3, 0.1
    sigma_new, sigma_b = split_noise_multiplier(sigma, k, r, sensitivity=1.0)
    assert k * sigma**2 / sigma_b**2 == pytest.approx(r)
    assert sigma_new**-2 + k / sigma_b**2 == pytest.approx(sigma**-2)
    engine = PrivacyEngine(
        TwoHeads(),
        batch_size=8,
        sample_size=80,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
        clipping="per_layer",
        adaptive=NORM,
    )
    assert engine.count_noise_multiplier == pytest.approx(sigma * math.sqrt(2 / 0.1))


def test_a_negative_released_sum_is_floored():
    config = AdaptiveConfig(**NORM)
    updated = update_thresholds_from_norms(
        torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([-3.0, 8.0]), 4, config, 1.0
    )
    torch.testing.assert_close(updated, torch.tensor([0.1, 3.0], dtype=torch.float64))


@pytest.mark.parametrize(("key", "value"), [("method", "mean"), ("norm_factor", 0.0), ("bound_factor", -1.0)])
def test_bad_norm_keys_are_refused(key, value):
    with pytest.raises(ValueError, match=f"adaptive.{key}"):
        AdaptiveConfig(**{**NORM, key: value})


def test_training_with_norm_based_thresholds(compose_config, tmp_path):
    record = run_training(compose_config([*TINY_RUN, "clip=norm_adaptive_perlayer"]), tmp_path)
    assert record["status"] == "completed" and math.isfinite(record["loss"])
