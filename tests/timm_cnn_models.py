"""Tiny float64 timm CNNs (ConvNeXt, ConvNeXt-V2, EfficientNet with GroupNorm) for the oracle and sensitivity
tests: every module they hold has a per-example gradient rule (timm LayerNorm2d, ConvNeXt layer scale, Global
Response Normalization, GroupNormAct, depthwise and squeeze-excite convolutions)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tests.engine_models import Batch, classification_loss


def convnext(conv_mlp: bool = False, grn: bool = False) -> nn.Module:
    """ConvNeXt (four stages of one block, widths 4-8, a 1x1 patch stem) on 8x8 images; layer scales and norm
    scales drawn away from 0 (timm starts gamma at 1e-6, which would hide a wrong rule), signed. ``grn``:
    ConvNeXt-V2's blocks (Global Response Normalization in the MLP, no layer scale), GRN's scale and shift
    drawn away from their zero start."""
    from timm.models.convnext import ConvNeXt

    model = ConvNeXt(
        in_chans=3,
        num_classes=3,
        depths=(1, 1, 1, 1),
        dims=(4, 8, 8, 8),
        patch_size=1,
        conv_mlp=conv_mlp,
        head_hidden_size=8,
        use_grn=grn,
        ls_init_value=None if grn else 1e-6,
    )
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if (
            name.endswith("gamma")
            or (p.dim() == 1 and "norm" in name and name.endswith("weight"))
            or ".grn." in name
        ):
            with torch.no_grad():
                p.copy_(
                    torch.empty_like(p).uniform_(0.5, 1.5, generator=gen)
                    * torch.randn(p.shape, generator=gen).sign()
                )
    return model.double().eval()


def efficientnet() -> nn.Module:
    """timm's ``test_efficientnet`` (inverted residuals, depthwise convs, squeeze-excite, SiLU) built with
    GroupNorm + activation layers instead of BatchNorm."""
    import timm
    from timm.layers import GroupNormAct

    model = timm.create_model(
        "test_efficientnet", pretrained=False, num_classes=3, norm_layer=partial(GroupNormAct, num_groups=4)
    )
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GroupNormAct):
                module.weight.normal_(1.0, 0.3, generator=gen)
                module.bias.normal_(0.0, 0.3, generator=gen)
    return model.double().eval()


BUILDERS = {
    "convnext": convnext,
    "convnext_conv_mlp": partial(convnext, conv_mlp=True),
    "convnextv2": partial(convnext, grn=True),
    "convnextv2_conv_mlp": partial(convnext, conv_mlp=True, grn=True),
    "efficientnet": efficientnet,
}


def make_timm_case(name: str, batch_size: int = 6, seed: int = 0) -> tuple[nn.Module, object, Batch]:
    """(model, per-example loss, batch of 8x8 RGB images with 3 classes) for ``name`` in ``BUILDERS``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = {
        "x": torch.randn(batch_size, 3, 8, 8, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, 3, (batch_size,), generator=gen),
    }
    return BUILDERS[name](), classification_loss, batch
