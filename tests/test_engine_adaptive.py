"""Adaptive thresholds (He et al. Algorithm 1) converge to the target quantile; sigma follows Prop. 3.1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine


class TwoHeads(nn.Module):
    """loss_i = <w1, x_i> + <w2, 3 y_i>: the per-example gradients are the inputs themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 1, bias=False)
        self.second = nn.Linear(8, 1, bias=False)

    def forward(self, x, y):
        return self.first(x).squeeze(1) + self.second(3 * y).squeeze(1)


@pytest.mark.parametrize("quantile", [0.3, 0.7])
def test_thresholds_converge_to_target_quantile(quantile):
    torch.manual_seed(0)
    model = TwoHeads()
    engine = PrivacyEngine(
        model,
        batch_size=256,
        sample_size=10_000,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        clipping="per_layer",
        adaptive={"target_quantile": quantile, "quantile_lr": 0.3, "budget_fraction": 0.05},
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    for _ in range(300):
        x, y = torch.randn(256, 16), torch.randn(256, 8)
        engine.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()
    fresh_x, fresh_y = torch.randn(20_000, 16), 3 * torch.randn(20_000, 8)
    for k, norms in enumerate([fresh_x.norm(dim=1), fresh_y.norm(dim=1)]):
        fraction_unclipped = float((norms <= engine.thresholds[k]).double().mean())
        assert abs(fraction_unclipped - quantile) < 0.1, (k, fraction_unclipped)


def test_rescaling_keeps_global_norm():
    torch.manual_seed(0)
    model = TwoHeads()
    engine = PrivacyEngine(
        model,
        batch_size=64,
        sample_size=1000,
        max_grad_norm=2.0,
        noise_multiplier=1.0,
        clipping="per_layer",
        adaptive={"target_quantile": 0.5, "rescale_to_global": True},
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    for _ in range(5):
        engine.backward(model(torch.randn(64, 16), torch.randn(64, 8)))
        optimizer.step()
    assert float(engine.thresholds.pow(2).sum().sqrt()) == pytest.approx(2.0)
    assert engine.thresholds[0] != engine.thresholds[1]


def test_budget_split_follows_proposition_3_1():
    sigma, r = 1.3, 0.01
    engine = PrivacyEngine(
        TwoHeads(),
        batch_size=64,
        sample_size=1000,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
        clipping="per_layer",
        adaptive={"budget_fraction": r},
    )
    k = 2
    s_new, s_b = engine.gradient_noise_multiplier, engine.count_noise_multiplier
    assert s_new == pytest.approx((sigma**-2 - k / (2 * s_b) ** 2) ** -0.5)
    assert k * sigma**2 / (4 * s_b**2) == pytest.approx(r)  # Remark 3.1
    assert s_new > sigma


def _centred_counts_after(model, x, y, thresholds):
    engine = PrivacyEngine(
        model,
        batch_size=8,
        sample_size=100,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        clipping="per_layer",
        thresholds=thresholds,
        adaptive={"budget_fraction": 0.5},
    )
    engine.backward(model(x, y))
    counts = engine.adaptive_statistics
    engine.detach()
    return counts


def test_released_count_has_sensitivity_one_half():
    """The count statistic released for adaptive thresholds is centred: removing any one example (clipped or
    not, in either group) moves each group's count by exactly 1/2, the sensitivity the budget split of
    Proposition 3.1 pays for (the uncentred count would move by 0 or 1)."""
    torch.manual_seed(0)
    model = TwoHeads()
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    x[0] = 0.0  # a zero-gradient example (never clipped)
    x[1] *= 1e6  # a huge one (always clipped)
    thresholds = [4.0, 5.0]  # about half the examples clipped in each group
    full = _centred_counts_after(model, x, y, thresholds)
    norms = torch.stack([x.norm(dim=1), (3 * y).norm(dim=1)], 1)
    expected = ((norms <= torch.tensor(thresholds)).double() - 0.5).sum(0)
    torch.testing.assert_close(full, expected)
    for j in range(8):
        keep = [i for i in range(8) if i != j]
        reduced = _centred_counts_after(model, x[keep], y[keep], thresholds)
        assert torch.allclose((full - reduced).abs(), torch.full((2,), 0.5, dtype=torch.float64))


def test_threshold_update_reads_the_centred_count_with_the_expected_batch_size():
    from dpexp.privacy.adaptive import AdaptiveConfig, update_thresholds

    config = AdaptiveConfig(target_quantile=0.5, quantile_lr=0.3)
    thresholds = torch.tensor([1.0, 1.0], dtype=torch.float64)
    # B = 10 expected; centred counts +5 (all 10 unclipped) and -5 (all clipped): fractions 1 and 0
    updated = update_thresholds(thresholds, torch.tensor([5.0, -5.0]), 10, config, global_norm=1.0)
    torch.testing.assert_close(updated, torch.exp(torch.tensor([-0.15, 0.15], dtype=torch.float64)))


def test_fixed_thresholds_count_nothing():
    """Without adaptive thresholds no statistic is counted (nothing would release it): the statistics stay
    zero, where the same step with adaptive thresholds counts every example in every group."""
    torch.manual_seed(0)
    model = TwoHeads()
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    engine = PrivacyEngine(
        model, batch_size=8, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0, clipping="per_layer"
    )
    engine.backward(model(x, y))
    assert not engine.adaptive_statistics.any()
    engine.detach()
    counts = _centred_counts_after(model, x, y, [1e6] * len(engine.groups))  # every example unclipped
    assert torch.equal(counts, torch.full_like(counts, 8 / 2))
