"""Hugging Face BEiT's (and data2vec-vision's) layer scale ``lambda_1``, ``lambda_2``, owned by the layer and
multiplied into both residual branches before its one ``drop_path``: against the brute-force oracle in every
strategy x clipping mode (float64, two micro-batches), with drop-path on (the per-example masks of each
forward reproduced for the oracle), a frozen lambda, and the refusal of a vanishing lambda."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy.capture import unsupported_modules
from tests.layer_models import BeitLayerNet as LayerNet
from tests.layer_models import beit_loss as loss_fn
from tests.oracle import SETTINGS, check_clipped_step, clipped_mean, engine_update, group_norms, slice_batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 4, 5, generator=gen, dtype=torch.float64), "y": torch.arange(6) % 3}


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
def test_layers_have_a_rule(kind):
    assert unsupported_modules(LayerNet(kind)) == {}


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_beit_layer_scale_matches_oracle(kind, strategy, clipping, groups):
    torch.manual_seed(0)
    model = LayerNet(kind).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the layer must not take the fallback
        check_clipped_step(model, loss_fn, _batch(), MICRO, strategy, clipping, groups)


def test_frozen_lambda_matches_oracle():
    torch.manual_seed(0)
    model = LayerNet("beit").double()
    model.layers[0].lambda_2.requires_grad_(False)
    model.layers[1].lambda_1.requires_grad_(False)
    check_clipped_step(model, loss_fn, _batch(), MICRO, "ghost", "per_layer")


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_drop_path_matches_oracle_on_the_same_masks(strategy):
    """Drop-path draws per-example masks in every forward: the engine's micro-batch forwards and the
    oracle's (per-example gradients from the same batch forward, one autograd call per example's loss) run
    under the same seeds, so they see the same masks."""
    torch.manual_seed(0)
    model = LayerNet("beit", drop_path=0.5).double().train()
    batch = {**_batch(), "seed": torch.tensor([10, 10, 10, 11, 11, 11])}

    def seeded_loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(int(b["seed"][0]))
        return loss_fn(m, b)

    params = dict(model.named_parameters())
    grads = []
    for index in MICRO:
        losses = seeded_loss(model, slice_batch(batch, index))
        for loss in losses:
            parts = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
            grads.append(dict(zip(params, parts, strict=True)))
    partition = [list(params)]  # flat clipping: one group
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()
    expected = clipped_mean(grads, partition, thresholds, batch_size=6)
    delta, _ = engine_update(
        copy.deepcopy(model), seeded_loss, batch, MICRO, batch_size=6, strategy=strategy,
        clipping="flat", thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    dropped = [float(g["layers.0.lambda_1"].abs().sum()) == 0 for g in grads]
    assert any(dropped) and not all(dropped)  # some examples' branches were dropped, some kept
    for name, want in expected.items():
        assert (delta[name] - want).norm() < 1e-9 * want.norm() + 1e-14, name


def test_vanishing_lambda_is_refused():
    from dpexp.privacy import PrivacyEngine

    model = LayerNet("beit").double()
    with torch.no_grad():
        model.layers[1].lambda_2[3] = 0.0
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"BeitLayer: a layer-scale lambda_2 is below .*freeze it"):
        engine.backward(loss_fn(model, _batch()))
