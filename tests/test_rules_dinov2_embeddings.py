"""Hugging Face DINOv2's embeddings (``cls_token``, ``mask_token``, ``position_embeddings``) against the
brute-force oracle in every strategy x clipping mode (float64, two micro-batches), without and with
``bool_masked_pos`` (the mask token's gradient is the sum of the masked positions' token gradients, zero
for an example without masked patches), and the refusals of what the rule does not model: resampled
(interpolated) position embeddings, embedding dropout in training, a mask that is not one row per image."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
SETTINGS = [
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]


class Classifier(nn.Module):
    """A two-layer DINOv2 on 8x8 images in 4x4 patches (a 2x2 grid), its pooled output -> head."""

    def __init__(self, hidden_dropout: float = 0.0) -> None:
        super().__init__()
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
            patch_size=4, num_channels=3, layerscale_value=0.5, hidden_dropout_prob=hidden_dropout,
        )  # fmt: skip
        self.backbone = Dinov2Model(config)
        with torch.no_grad():  # away from their zero start, so that every token matters
            self.backbone.embeddings.cls_token.normal_()
            self.backbone.embeddings.mask_token.normal_()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.backbone(pixel_values=x, bool_masked_pos=mask).pooler_output)


def loss_fn(model: Classifier, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"], batch.get("mask")), batch["y"], reduction="none")


def _batch(masked: bool, size: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    batch = {
        "x": torch.randn(6, 3, size, size, generator=gen, dtype=torch.float64),
        "y": torch.arange(6) % 3,
    }
    if masked:  # examples 1 and 4 without masked patches, example 3 fully masked
        mask = torch.rand(6, 4, generator=gen) < 0.5
        mask[0, 0] = True
        mask[[1, 4]] = False
        mask[3] = True
        batch["mask"] = mask
    return batch


def test_dinov2_needs_no_fallback():
    assert unsupported_modules(Classifier()) == {}


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_dinov2_embeddings_match_oracle(masked, strategy, clipping, groups):
    torch.manual_seed(0)
    model = Classifier().double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the embeddings must not take it
        check_clipped_step(model, loss_fn, _batch(masked), MICRO, strategy, clipping, groups)


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


@pytest.mark.parametrize(
    "model,batch,match",
    [
        (
            lambda: Classifier(),
            lambda: _batch(False, size=12),
            r"9 patches .* table of 4, so the module resamples",
        ),
        (lambda: Classifier(hidden_dropout=0.1), lambda: _batch(False), r"embedding dropout \(p=0.1\)"),
        (
            lambda: Classifier(),
            lambda: {**_batch(False), "mask": torch.ones(1, 4, dtype=torch.bool)},
            r"bool_masked_pos has shape \(1, 4\).*\(6, 4\)",
        ),
    ],
    ids=["interpolated_positions", "embedding_dropout", "broadcast_mask"],
)
def test_what_the_rule_does_not_model_is_refused(model, batch, match):
    net = model().double()
    engine = _engine(net)
    with pytest.raises(ValueError, match=r"Dinov2Embeddings\): .*" + match):
        engine.backward(loss_fn(net, batch()))
