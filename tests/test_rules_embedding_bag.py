"""nn.EmbeddingBag against the brute-force oracle: 2-D bags and 1-D inputs with offsets, sum and mean,
per-sample weights, padding_idx, every strategy x clipping mode; the sensitivity under removal; refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.layer_models import BagNet, bag_batch, bag_loss
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


VARIANTS = {
    "rows-sum": ("sum", "rows", False, None, False),
    "rows-mean-padding": ("mean", "rows", False, 0, False),
    "rows-weighted": ("sum", "rows", True, None, False),
    "offsets-sum": ("sum", "offsets", False, None, False),
    "offsets-mean-padding-last": ("mean", "offsets", False, 0, True),
    "offsets-weighted-padding": ("sum", "offsets", True, 0, False),
}
SETTINGS = [(s, c) for s in ("bk", "ghost", "instantiate") for c in ("flat", "per_layer")]


def _check(variant: str, strategy: str, clipping: str) -> None:
    torch.manual_seed(0)
    model = BagNet(*VARIANTS[variant]).double()
    batch = bag_batch()
    grads = per_example_grads(model, bag_loss, batch)
    partition = PrivacyEngine(
        BagNet(*VARIANTS[variant]).double(), batch_size=6, sample_size=60, max_grad_norm=1.0,
        noise_multiplier=0.0, clipping=clipping,
    ).groups  # fmt: skip
    thresholds = group_norms(grads, partition).median(0).values.tolist()
    expected = clipped_mean(grads, partition, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, bag_loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, clipping=clipping, strategy=strategy,
        thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for name, want in expected.items():
        err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-6, f"{variant}/{strategy}/{clipping}: {name} relative error {err:.2e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_embedding_bag_matches_the_oracle(variant):
    _check(variant, "bk", "per_layer")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("strategy,clipping", SETTINGS)
def test_embedding_bag_matches_the_oracle_everywhere(variant, strategy, clipping):
    _check(variant, strategy, clipping)


def test_embedding_bag_needs_no_fallback():
    from dpexp.privacy.capture import unsupported_modules

    assert not any("EmbeddingBag" in kind for kind in unsupported_modules(BagNet("sum", "offsets", True, 0)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "max"}, "mode='max'"),
        ({"max_norm": 1.0}, "max_norm"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
    ],
)
def test_unsupported_embedding_bags_are_refused(kwargs, message):
    model = nn.Sequential(nn.EmbeddingBag(10, 4, **kwargs), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=message):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
