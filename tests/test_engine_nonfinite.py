"""An example whose per-example gradient is not finite (an overflow, or ``inf * 0`` inside a ghost norm)
contributes nothing to its group's clipped sum instead of turning the release into NaN, which would tell its
presence for certain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.oracle import engine_update

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _loss(model, batch):
    return model(batch["x"]).pow(2).sum(1)


def _update(x: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
    delta, _ = engine_update(
        _model(), _loss, {"x": x}, [list(range(len(x)))], batch_size=len(x), max_grad_norm=1.0, **kwargs
    )
    return delta


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("norm_mode", ["ghost", "instantiate"])
def test_saturating_example_is_exact(strategy, norm_mode):
    """Inputs of 1e300 saturate tanh: the example's gradient in the first layer is exactly 0, but its ghost
    norm is inf * 0. The update equals the one without that example's (zero) first-layer gradient."""
    x = torch.randn(4, 3, dtype=torch.float64)
    huge = x.clone()
    huge[0] = 1e300
    delta = _update(huge, strategy=strategy, norm_mode=norm_mode, clipping="per_layer")
    assert all(torch.isfinite(d).all() for d in delta.values())
    # the first layer gets nothing from example 0 (tanh' = 0 there): same as dropping it from the batch
    rest = _update(x[1:], strategy=strategy, norm_mode=norm_mode, clipping="per_layer")
    torch.testing.assert_close(delta["0.weight"] * 4, rest["0.weight"] * 3)


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_example_with_a_non_finite_gradient_is_dropped_from_its_groups(strategy, clipping):
    """An infinite input makes the first layer's gradient NaN (0 * inf): that group drops the example, and
    the others are as if it contributed there only what it contributes finitely."""
    x = torch.randn(4, 3, dtype=torch.float64)
    bad = x.clone()
    bad[0] = float("inf")
    delta = _update(bad, strategy=strategy, clipping=clipping)
    assert all(torch.isfinite(d).all() for d in delta.values())
    if clipping == "flat":  # the whole gradient of example 0 is dropped
        rest = _update(x[1:], strategy=strategy, clipping=clipping)
        for name in delta:
            torch.testing.assert_close(delta[name] * 4, rest[name] * 3)
