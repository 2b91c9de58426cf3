"""Hugging Face DINOv2's embeddings (``cls_token``, ``mask_token``, ``position_embeddings``; and with register
tokens, ``register_tokens``, the positions resampled antialiased) against the brute-force oracle in every
strategy x clipping mode (float64, two micro-batches), without and with ``bool_masked_pos`` (the mask token's
gradient is the sum of the masked positions' token gradients, zero for an example without masked patches),
resampled (interpolated) position embeddings for other image sizes (in float32), and the refusals of what
the rule cannot establish: embedding dropout in training, resampling in a float64 model, a mask that is not
one row per image."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.layer_models import Dinov2Net as Classifier
from tests.layer_models import dinov2_loss as loss_fn
from tests.layer_models import masked_image_batch
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


REGISTERS = pytest.mark.parametrize("registers", [0, 2], ids=["dinov2", "registers"])


@REGISTERS
def test_dinov2_needs_no_fallback(registers):
    assert unsupported_modules(Classifier(registers=registers)) == {}


@REGISTERS
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_dinov2_embeddings_match_oracle(masked, strategy, clipping, groups, registers):
    torch.manual_seed(0)
    model = Classifier(registers=registers).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the embeddings must not take it
        check_clipped_step(model, loss_fn, masked_image_batch(masked), MICRO, strategy, clipping, groups)


@REGISTERS
@pytest.mark.parametrize(
    "height,width", [(12, 12), (8, 12), (4, 8)], ids=["3x3_grid", "2x3_grid", "1x2_grid"]
)
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_resampled_positions_match_oracle(strategy, height, width, registers):
    """Images of another size: the module resamples its 2x2 table of patch positions (bicubic, always in
    float32) to the patch grid; the per-example gradient goes back through that resampling. In float32, as
    the resampling is (a float64 model is refused: the engine's check that the per-example gradients add up
    to autograd's would fail by the float32 rounding of the resampling's backward, about 1e-8 relative)."""
    torch.manual_seed(0)
    batch = {
        k: v.float() if v.is_floating_point() else v
        for k, v in masked_image_batch(False, height, width).items()
    }
    model = Classifier(registers=registers)
    check_clipped_step(model, loss_fn, batch, MICRO, strategy, "per_layer", rel=1e-5, floor=1e-6)


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


@pytest.mark.parametrize(
    "model,batch,match",
    [
        (
            lambda: Classifier(hidden_dropout=0.1),
            lambda: masked_image_batch(False),
            r"embedding dropout \(p=0.1\)",
        ),
        (
            lambda: Classifier(),
            lambda: masked_image_batch(False, 12, 12),
            r"resamples position_embeddings .* in float32",
        ),
        (
            lambda: Classifier(),
            lambda: {**masked_image_batch(False), "mask": torch.ones(1, 4, dtype=torch.bool)},
            r"bool_masked_pos has shape \(1, 4\).*\(6, 4\)",
        ),
    ],
    ids=["embedding_dropout", "float64_resampled", "broadcast_mask"],
)
def test_what_the_rule_does_not_model_is_refused(model, batch, match):
    net = model().double()
    engine = _engine(net)
    with pytest.raises(ValueError, match=r"Dinov2Embeddings\): .*" + match):
        engine.backward(loss_fn(net, batch()))
