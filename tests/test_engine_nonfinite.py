"""An example whose per-example gradient is not finite (an overflow, or ``inf * 0`` inside a ghost norm)
contributes nothing to its group's clipped sum instead of turning the release into NaN, which would tell its
presence for certain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import clipping
from dpexp.privacy.per_example import Dense, OneHot, Outer, PerExampleGrad, Routed
from dpexp.privacy.rules.conv import ConvWeightGrads
from dpexp.privacy.rules.ws_conv import Standardized
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


@pytest.fixture(params=[True, False], ids=["asked on host", "masked on device"])
def host(request, monkeypatch):
    """Both ways the clipper learns which norms were finite (:func:`clipping.finiteness_on_host`): the CPU
    asks the host, an accelerator masks on the device; each must drop the same examples."""
    monkeypatch.setattr(clipping, "finiteness_on_host", lambda device: request.param)
    return request.param


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping_mode", ["flat", "per_layer"])
def test_both_ways_of_dropping_an_example_release_the_same_sums(host, strategy, clipping_mode):
    """With an infinite input (NaN first-layer gradient) and one saturating input (``inf * 0`` ghost norm),
    the release is finite and equals the one of the clipper that asks the host."""
    x = torch.randn(5, 3, dtype=torch.float64)
    x[0], x[3] = float("inf"), 1e300
    delta = _update(x, strategy=strategy, clipping=clipping_mode)
    assert all(torch.isfinite(d).all() for d in delta.values())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clipping, "finiteness_on_host", lambda device: True)
        reference = _update(x, strategy=strategy, clipping=clipping_mode)
    for name in delta:
        torch.testing.assert_close(delta[name], reference[name], rtol=1e-12, atol=0)


def _spoiled(x: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``x`` (B, ...) with inf and NaN in the rows of the dropped examples."""
    x = x.clone()
    x[drop] = float("inf")
    x[drop.nonzero()[0]].view(-1)[0] = float("nan")
    return x


def _grads() -> dict[str, tuple[PerExampleGrad, PerExampleGrad]]:
    """Each kind of per-example gradient twice: with finite factors, and with the dropped examples' factors
    spoiled (:func:`_spoiled`)."""
    torch.manual_seed(1)
    b, drop = 4, torch.tensor([False, True, False, True])
    left, right = torch.randn(b, 5, 3, dtype=torch.float64), torch.randn(b, 5, 2, dtype=torch.float64)
    index = torch.randint(0, 7, (b, 5))
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    conv.eps = 1e-5  # as a weight-standardised convolution has
    x, dy = torch.randn(b, 2, 6, 6, dtype=torch.float64), torch.randn(b, 3, 6, 6, dtype=torch.float64)
    example = torch.arange(b).repeat_interleave(3)  # three routed rows per example, over 2 experts
    expert = torch.tensor([0, 1, 1] * b)
    rows_left = torch.randn(3 * b, 3, dtype=torch.float64)
    rows_right = torch.randn(3 * b, 2, dtype=torch.float64)
    rows = drop[example]

    def both(make, *factors):
        spoiled = [_spoiled(f, rows if len(f) == 3 * b else drop) for f in factors]
        return make(*factors), make(*spoiled)

    def kept(grads):
        grads.retain()
        grads.per_example_chunks()
        return grads

    return {
        "dense": both(Dense, left),
        "one hot": both(lambda v: OneHot(torch.tensor([0, 3, 5, 3]), v, torch.Size([2, 3])), left[:, 0, 0]),
        "outer": both(lambda a, g: Outer(a, g, torch.Size([3, 2]), 3), left, right),
        "outer of indices": both(lambda g: Outer(index, g, torch.Size([7, 2]), 7), right),
        "outer, kept": both(lambda a, g: kept(Outer(a, g, torch.Size([3, 2]), 3)), left, right),
        "routed": both(lambda a, g: Routed(a, g, expert, example, b, (2, 3, 2)), rows_left, rows_right),
        "convolution": both(lambda a, g: ConvWeightGrads(conv, a, g), x, dy),
        "standardized": both(
            lambda a, g: Standardized(ConvWeightGrads(conv, a, g), conv.weight, 1e-5), x, dy
        ),
    }, drop


@pytest.mark.parametrize("kind", list(_grads()[0]))
def test_masked_gradients_sum_only_the_kept_examples(kind):
    """``masked(keep).weighted_sum(c)`` of gradients whose dropped examples hold inf and NaN is finite and
    equals ``sum_{i kept} c_i g_i`` of the finite gradients, with the same shapes (nothing awaits the
    device)."""
    (clean, spoiled), keep = _grads()[0][kind], ~_grads()[1]
    coef = torch.tensor([0.5, 0.0, 2.0, 0.0], dtype=torch.float64)  # the clipper's 0 for dropped examples
    expected = torch.einsum("b,b...->...", coef * keep, clean.instantiate())
    masked = spoiled.masked(keep)
    assert masked.batch_size == clean.batch_size
    torch.testing.assert_close(masked.weighted_sum(coef), expected, rtol=1e-12, atol=1e-12)
    assert not torch.isfinite(spoiled.weighted_sum(coef)).all()  # what masking prevents
