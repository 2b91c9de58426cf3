"""Vision models: WRN-16-4 (GroupNorm + weight standardisation, no BatchNorm) and timm ViT factories."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.layers import WSConv2d
from dpexp.models.base import TaskInfo
from dpexp.models.image_input import ImageInput
from dpexp.models.timm_image import TimmImageFactory
from dpexp.models.wrn import CIFAR10_MEAN, WideResNet, WideResNetFactory

CIFAR_INFO = TaskInfo("cifar10", "classification", num_labels=10, input_shape=(3, 32, 32))


def test_wrn16_4_shape_size_and_no_batchnorm() -> None:
    model = WideResNetFactory().build(CIFAR_INFO)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    modules = list(model.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    convs = [m for m in modules if isinstance(m, nn.Conv2d)]
    assert convs and all(isinstance(m, WSConv2d) for m in convs)
    assert len(convs) == 1 + 3 * 2 * 2 + 3  # stem, two convs per block, one projection per stage
    assert sum(isinstance(m, nn.GroupNorm) for m in modules) == 3 * 2 * 2 + 1
    assert 2.7e6 < sum(p.numel() for p in model.parameters()) < 2.8e6  # "2.8M" (He et al. 2023, sec. 5.1)


def test_small_wrn_trains_every_parameter() -> None:
    torch.manual_seed(0)
    model = WideResNet(depth=10, width=1, num_classes=4, num_groups=8)
    nn.init.normal_(
        model.head.weight
    )  # the zero-initialised head would block gradients to the body at step 0
    loss = nn.functional.cross_entropy(
        model(torch.rand(3, 3, 16, 16)), torch.tensor([0, 1, 3]), reduction="none"
    )
    assert loss.shape == (3,)
    loss.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_wrn_normalises_its_input_and_starts_with_zero_logits() -> None:
    model = WideResNet(depth=10, width=1, num_groups=8)
    assert torch.equal(model(torch.rand(2, 3, 8, 8)), torch.zeros(2, 10))
    pixels = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1).expand(1, 3, 4, 4)
    assert torch.allclose(model.input(pixels), torch.zeros(1, 3, 4, 4), atol=1e-6)


def test_wrn_rejects_bad_shapes_and_mismatched_tasks() -> None:
    with pytest.raises(ValueError, match="6n\\+4"):
        WideResNet(depth=15)
    with pytest.raises(ValueError, match="num_groups=24 must divide"):
        WideResNet(num_groups=24)
    factory = WideResNetFactory(width=1)
    with pytest.raises(
        ValueError, match="WRN-16-1 is an image classifier, but task e2e is a generation task"
    ):
        factory.build(TaskInfo("e2e", "generation", vocab_size=100))
    with pytest.raises(ValueError, match=r"needs images .* task sst2"):
        factory.build(TaskInfo("sst2", "classification", num_labels=2, vocab_size=100))


def test_timm_vit_resizes_and_normalises_inside_the_model() -> None:
    torch.manual_seed(0)
    model = TimmImageFactory("vit_tiny_patch16_224.augreg_in21k_ft_in1k", pretrained=False).build(CIFAR_INFO)
    assert isinstance(model.input, ImageInput) and model.input.size == (224, 224)
    seen = []
    model.net.patch_embed.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    model.eval()
    logits = model(torch.rand(2, 3, 32, 32))
    assert logits.shape == (2, 10) and seen == [(2, 3, 224, 224)]
    grey = torch.full((1, 3, 32, 32), 0.5)  # the pretraining mean (0.5) maps to zero
    assert torch.allclose(model.input(grey), torch.zeros(1, 3, 224, 224), atol=1e-6)


def test_timm_factory_refuses_text_tasks() -> None:
    factory = TimmImageFactory("vit_tiny_patch16_224", pretrained=False)
    with pytest.raises(ValueError, match="needs images"):
        factory.build(TaskInfo("sst2", "classification", num_labels=2, vocab_size=100))
