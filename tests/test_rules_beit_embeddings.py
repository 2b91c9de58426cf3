"""Hugging Face BEiT's (and data2vec-vision's) embeddings (``cls_token``, ``mask_token``,
``position_embeddings``) against the brute-force oracle in every strategy x clipping mode (float64, two
micro-batches), without and with ``bool_masked_pos`` (the mask token's gradient is the sum of the masked
positions' token gradients, zero for an example without masked patches), resampled (interpolated) position
embeddings for other image sizes (BEiT resamples in the table's dtype, so float64 is exact), without the
absolute position table, and the refusals of what the rule cannot establish: embedding dropout in
training, a mask that is not one row per image."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.layer_models import BeitNet, masked_image_batch
from tests.layer_models import beit_embeddings_loss as loss_fn
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
def test_beit_embeddings_need_no_fallback(kind):
    assert unsupported_modules(BeitNet(kind)) == {}


def _check(model: nn.Module, batch: dict[str, torch.Tensor], strategy: str, clipping: str, groups=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the embeddings must not take it
        check_clipped_step(model, loss_fn, batch, MICRO, strategy, clipping, groups)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_beit_embeddings_match_oracle(masked, strategy, clipping, groups):
    torch.manual_seed(0)
    _check(BeitNet().double(), masked_image_batch(masked), strategy, clipping, groups)


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_data2vec_vision_embeddings_match_oracle(strategy):
    """data2vec-vision's embeddings also return the patch grid's size (integers, no gradient)."""
    torch.manual_seed(0)
    _check(BeitNet("data2vec").double(), masked_image_batch(True), strategy, "per_layer")


@pytest.mark.parametrize("height,width", [(12, 12), (8, 12)], ids=["3x3_grid", "2x3_grid"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_resampled_positions_match_oracle(strategy, height, width):
    """Images of another size: the module resamples its 2x2 table of patch positions (bicubic, in the
    table's dtype) to the patch grid; the per-example gradient goes back through that resampling, exactly
    in float64."""
    torch.manual_seed(0)
    _check(BeitNet().double(), masked_image_batch(True, height, width), strategy, "per_layer")


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_without_absolute_positions_matches_oracle(strategy):
    torch.manual_seed(0)
    model = BeitNet(absolute=False).double()
    assert model.backbone.embeddings.position_embeddings is None
    _check(model, masked_image_batch(True), strategy, "flat")


def test_frozen_mask_token_matches_oracle():
    torch.manual_seed(0)
    model = BeitNet().double()
    model.backbone.embeddings.mask_token.requires_grad_(False)
    _check(model, masked_image_batch(True), "ghost", "per_layer")


@pytest.mark.parametrize(
    "model,batch,match",
    [
        (
            lambda: BeitNet(hidden_dropout=0.1),
            lambda: masked_image_batch(False),
            r"embedding dropout \(p=0.1\)",
        ),
        (
            lambda: BeitNet(),
            lambda: {**masked_image_batch(False), "mask": torch.ones(1, 4, dtype=torch.bool)},
            r"bool_masked_pos has shape \(1, 4\).*\(6, 4\)",
        ),
    ],
    ids=["embedding_dropout", "broadcast_mask"],
)
def test_what_the_rule_does_not_model_is_refused(model, batch, match):
    net = model().double()
    engine = PrivacyEngine(net, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"BeitEmbeddings\): .*" + match):
        engine.backward(loss_fn(net, batch()))
