"""Tiny float64 timm CNNs (ConvNeXt, ConvNeXt-V2, EfficientNet with GroupNorm, an NF-ResNet, a BiT ResNet-V2),
their Hugging Face forms (ConvNeXt, ConvNeXt V2, BiT) and torchvision's ConvNeXt, ViT and Swin for the oracle
and sensitivity tests: every module they hold has a per-example gradient rule (timm's and torchvision's
LayerNorm2d and Hugging Face's LayerNorm of either data format, ConvNeXt layer scale, Global Response
Normalization, GroupNormAct and BiT's GroupNorm with its activation, depthwise and squeeze-excite
convolutions, scaled and plain weight-standardised convolutions, torchvision ViT's class token and position
embedding, and (stop 61) Swin's shifted window attention of either version)."""

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


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    """Gains, biases and the head drawn away from their constant or zero start (which would hide a wrong
    rule), in float64."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            drawn = ("head", "fc.", ".grn.", "layer_scale", "class_token", "pos_embedding")
            if p.dim() <= 1 or name.endswith("gain") or any(part in name for part in drawn):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.double().eval()


def nf_resnet(skipinit: bool = False) -> nn.Module:
    """A two-stage NF-ResNet (Brock et al. 2021; timm's NormFreeNet): ScaledStdConv2d everywhere (a learnable
    gain per output channel, grouped 3x3 convolutions), squeeze-excite, no normalisation layer. ``skipinit``:
    dm_nfnet's blocks, each owning a scalar ``skipinit_gain`` that scales its residual branch in place (drawn
    away from its 0 start here)."""
    from timm.models.nfnet import NfCfg, NormFreeNet

    cfg = NfCfg(
        depths=(1, 1),
        channels=(8, 16),
        stem_chs=8,
        stem_type="",
        group_size=4,
        bottle_ratio=0.5,
        attn_layer="se",
        attn_kwargs={"rd_ratio": 0.5},
        act_layer="silu",
        num_features=16,
        skipinit=skipinit,
    )
    return _perturbed(NormFreeNet(cfg, num_classes=3, in_chans=3), 3)


def bit() -> nn.Module:
    """A two-stage BiT ResNet-V2 (Kolesnikov et al. 2020): timm's StdConv2d (weight standardisation) with
    GroupNorm and activation."""
    from timm.layers import GroupNormAct, StdConv2d
    from timm.models.resnetv2 import ResNetV2

    model = ResNetV2(
        layers=(1, 1),
        channels=(8, 16),
        num_classes=3,
        stem_chs=8,
        conv_layer=partial(StdConv2d, eps=1e-8),
        norm_layer=partial(GroupNormAct, num_groups=2),
    )
    return _perturbed(model, 4)


class SameConvs(nn.Module):
    """timm's ``*Same`` standardised convolutions (TensorFlow SAME padding, uneven at stride 2 with an even
    kernel), scaled ones grouped; for 9x9 images, whatever the case's size."""

    def __init__(self) -> None:
        from timm.layers import ScaledStdConv2dSame, StdConv2dSame

        super().__init__()
        self.a = ScaledStdConv2dSame(3, 4, 3, stride=2)
        self.b = StdConv2dSame(4, 6, 4, stride=2, bias=True)
        self.c = ScaledStdConv2dSame(6, 6, 2, groups=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.interpolate(x, size=(9, 9))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))).mean((2, 3)))


class Logits(nn.Module):
    """A Hugging Face image classifier called on pixel values, returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def hf_image_classifier(architecture: str, seed: int, **config) -> nn.Module:
    """A Hugging Face image classifier of 3 classes for 8x8 images, its parameters drawn away from their
    starts (ConvNeXt's layer scale 1e-6, GRN's zeros, the norms' ones) and signed."""
    from transformers import AutoConfig, AutoModelForImageClassification

    config = AutoConfig.for_model(architecture, num_labels=3, image_size=8, **config)
    return Logits(_perturbed(AutoModelForImageClassification.from_config(config), seed))


def hf_convnext(v2: bool = False) -> nn.Module:
    """Hugging Face ConvNeXt (or V2: GRN in the MLP, no layer scale): two stages of one block, widths 4 and 8,
    a 2x2 patch stem; its LayerNorms channels-first (the stem's, the downsampling's) and channels-last (the
    blocks')."""
    sizes = {"depths": [1, 1], "hidden_sizes": [4, 8], "num_stages": 2, "patch_size": 2}
    return hf_image_classifier(
        "convnextv2" if v2 else "convnext", 6 if v2 else 7, **sizes, drop_path_rate=0.0
    )


def hf_bit() -> nn.Module:
    """Hugging Face BiT (pre-activation ResNet-V2): weight-standardised convolutions with TensorFlow's SAME
    padding by its ``DynamicPad2d`` (uneven at stride 2), GroupNorm with ReLU."""
    sizes = {"depths": [1, 1], "hidden_sizes": [8, 16], "embedding_size": 8, "num_groups": 2}
    return hf_image_classifier("bit", 8, **sizes, global_padding="SAME", layer_type="preactivation")


def hf_hiera() -> nn.Module:
    """Hugging Face Hiera: two stages of one block (widths 8 and 16), 3 x 3 patches at stride 2 (a 4 x 4 token
    grid), a query pool after the first stage, an absolute position table added to the patch embeddings
    (``HieraEmbeddings``, which returns a tuple)."""
    from transformers import HieraConfig, HieraForImageClassification

    config = HieraConfig(
        image_size=[8, 8], patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1], embed_dim=8,
        depths=[1, 1], num_heads=[1, 2], query_stride=[2, 2], masked_unit_size=[2, 2], num_query_pool=1,
        num_labels=3,
    )  # fmt: skip
    return Logits(_perturbed(HieraForImageClassification(config), 9))


def tv_convnext() -> nn.Module:
    """torchvision's ConvNeXt: two stages of one block (widths 4 and 8), its ``LayerNorm2d`` (stem,
    downsampling, classifier) and ``CNBlock``'s ``layer_scale`` (C, 1, 1), to which the block adds its
    shortcut in place."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return _perturbed(ConvNeXt([CNBlockConfig(4, 8, 1), CNBlockConfig(8, None, 1)], num_classes=3), 10)


def tv_vit() -> nn.Module:
    """torchvision's Vision Transformer on 8x8 images (4x4 patches, 2 layers, width 8, 2 heads): its own
    ``class_token`` and its ``Encoder``'s ``pos_embedding``, ``nn.MultiheadAttention`` in self-attention
    without weights returned."""
    from torchvision.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(
        image_size=8, patch_size=4, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3
    )
    return _perturbed(vit, 11)


def tv_swin(v2: bool = False) -> nn.Module:
    """torchvision's Swin (``ShiftedWindowAttention``; ``v2``: ``ShiftedWindowAttentionV2`` with
    ``PatchMergingV2``) on 8x8 images: 2x2 patches, two stages of two blocks (widths 8 and 16, 2 heads),
    windows of 3. The first stage's 4x4 map is padded to 6x6 and its second block's windows shifted; the
    second stage's 2x2 map is padded to one window, unshifted. Position tables drawn away from their small
    start; in V2 one head's temperature above the clamp at log 100, where its gradient is zero."""
    from torchvision.models import swin_transformer as swin

    kwargs = {"block": swin.SwinTransformerBlockV2, "downsample_layer": swin.PatchMergingV2} if v2 else {}
    model = swin.SwinTransformer(
        patch_size=[2, 2], embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=[3, 3], num_classes=3,
        stochastic_depth_prob=0.0, **kwargs,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name or "logit_scale" in name or "cpb_mlp" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        if v2:
            model.features[1][0].attn.logit_scale[0] = 5.0
    return _perturbed(model, 13)


BUILDERS = {
    "convnext": convnext,
    "convnext_conv_mlp": partial(convnext, conv_mlp=True),
    "convnextv2": partial(convnext, grn=True),
    "convnextv2_conv_mlp": partial(convnext, conv_mlp=True, grn=True),
    "efficientnet": efficientnet,
    "nf_resnet": nf_resnet,
    "nfnet_skipinit": partial(nf_resnet, skipinit=True),
    "bit": bit,
    "std_conv_same": lambda: _perturbed(SameConvs(), 5),
    "hf_convnext": hf_convnext,
    "hf_convnextv2": partial(hf_convnext, v2=True),
    "hf_bit": hf_bit,
    "hf_hiera": hf_hiera,
    "tv_convnext": tv_convnext,
    "tv_vit": tv_vit,
    "tv_swin": tv_swin,
    "tv_swinv2": partial(tv_swin, v2=True),
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
