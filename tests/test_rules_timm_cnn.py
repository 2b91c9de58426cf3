"""timm CNN rules (LayerNorm2d, ConvNeXt layer scale, GroupNormAct) against the brute-force oracle: every
strategy x clipping mode on tiny ConvNeXt and EfficientNet models (slow), one representative in the fast
suite, and no module of these models on the torch.func fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.oracle import check_clipped_step, clipped_mean, engine_update, group_norms, per_example_grads
from tests.timm_cnn_models import BUILDERS, make_timm_case

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

SETTINGS = [
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]
FAST = {
    ("convnext", "bk", "per_layer"),
    ("efficientnet", "ghost", "flat"),
    ("convnext_conv_mlp", "instantiate", "groups"),
    ("convnextv2", "ghost", "per_layer"),
    ("convnextv2_conv_mlp", "bk", "flat"),
}


def _check(name: str, strategy: str, clipping: str, groups: int | None) -> None:
    model, loss_fn, batch = make_timm_case(name)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # a module on the fallback fails the test
        check_clipped_step(
            model, loss_fn, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, rel=1e-7
        )


@pytest.mark.parametrize(
    "name,strategy,clipping,groups",
    [
        pytest.param(n, s, c, g, marks=() if (n, s, c) in FAST else pytest.mark.slow, id=f"{n}-{s}-{c}")
        for n in BUILDERS
        for s, c, g in SETTINGS
    ],
)
def test_timm_cnn_matches_oracle(name, strategy, clipping, groups):
    _check(name, strategy, clipping, groups)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_module_has_a_rule(name):
    assert unsupported_modules(BUILDERS[name]()) == {}


def test_group_norm_act_rule_covers_the_activation():
    """dy arrives after the activation: a rule that ignored act'(z) would be wrong where ReLU is off. A
    single GroupNormAct with ReLU and a large negative bias in half of the channels checks it."""
    from timm.layers import GroupNormAct

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), GroupNormAct(4, num_groups=2, act_layer=nn.ReLU), nn.Flatten(), nn.LazyLinear(2)
    )
    model(torch.zeros(1, 2, 5, 5))
    model = model.double()
    with torch.no_grad():
        model[1].bias.copy_(torch.tensor([0.3, -3.0, 0.1, -0.2]))
        model[1].weight.normal_(1.0, 0.3)
    batch = {"x": torch.randn(4, 2, 5, 5, dtype=torch.float64)}

    def loss(m, b):
        return F.softplus(m(b["x"])).sum(1)

    grads = per_example_grads(model, loss, batch)
    groups = [list(grads[0])]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-9, atol=1e-12)


def test_layer_scale_refuses_a_vanishing_gamma():
    model, loss_fn, batch = make_timm_case("convnext", batch_size=2)
    with torch.no_grad():
        model.stages[0].blocks[0].gamma[3] = 0.0
    with pytest.raises(ValueError, match="layer-scale gamma is below"):
        engine_update(model, loss_fn, batch, [[0, 1]], batch_size=2, max_grad_norm=1.0)


def test_group_norm_act_refuses_a_random_drop_layer():
    from timm.layers import GroupNormAct

    model = nn.Sequential(nn.Conv2d(2, 4, 3), GroupNormAct(4, num_groups=2, drop_layer=nn.Dropout))
    with pytest.raises(ValueError, match=r"GroupNormAct.*drop layer Dropout"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
