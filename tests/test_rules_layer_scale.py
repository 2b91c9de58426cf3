"""Channels-last layer scale (timm ``LayerScale``, Hugging Face DINOv2/DINOv3 ``LayerScale``) against the
brute-force oracle: every strategy x clipping mode in float64 over padded sequences in two micro-batches,
a flattened (B*T, d) input, a whole DINOv2, and the refusal of timm's in-place variant."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.layer_models import ScaleNet, scale_loss
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 11, (6, 5), generator=gen)
    ids[0, 3:] = 0  # padding
    ids[2, 1:] = 0
    return {"ids": ids, "y": torch.randint(0, 3, (6,), generator=gen)}


MICRO = [[0, 1, 2], [3, 4, 5]]  # two micro-batches of one logical batch
SETTINGS = [
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]


@pytest.mark.parametrize("kind", ["timm", "dinov2", "dinov3"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_layer_scale_matches_oracle(kind, strategy, clipping, groups):
    torch.manual_seed(0)
    model = ScaleNet(kind).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the scale must not take the fallback
        check_clipped_step(model, scale_loss, _batch(), MICRO, strategy, clipping, groups)


def test_layer_scale_on_flattened_rows_matches_oracle():
    torch.manual_seed(0)
    check_clipped_step(
        ScaleNet("timm", flatten=True).double(), scale_loss, _batch(), MICRO, "bk", "per_layer"
    )


class Classifier(nn.Module):
    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(pixel_values=x).pooler_output)


def test_dinov2_matches_oracle_without_the_fallback():
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
        patch_size=4, num_channels=3, layerscale_value=0.5,
    )  # fmt: skip
    backbone = Dinov2Model(config).double()
    assert unsupported_modules(backbone) == {}  # its embeddings too: rules/vision_tokens.py
    model = Classifier(backbone, nn.Linear(16, 3).double())

    def loss(m, b):
        return F.cross_entropy(m(b["x"]), b["y"], reduction="none")

    gen = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(6, 3, 8, 8, generator=gen, dtype=torch.float64), "y": torch.arange(6) % 3}
    check_clipped_step(model, loss, batch, MICRO, "bk", "flat")


def test_in_place_layer_scale_is_refused():
    from timm.layers import LayerScale

    model = nn.Sequential(nn.Linear(4, 4), LayerScale(4, inplace=True))
    with pytest.raises(ValueError, match=r"LayerScale\(inplace=True\).*inplace=False"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
