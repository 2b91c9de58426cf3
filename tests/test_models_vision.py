"""Vision models: WRN-16-4 (GroupNorm + weight standardisation, no BatchNorm) and timm ViT factories."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.layers import WSConv2d, standardize_weight
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


DIGITS_INFO = TaskInfo("digits", "classification", num_labels=10, input_shape=(1, 8, 8))


@pytest.mark.parametrize(
    ("kwargs", "info"),
    [
        ({"model_name": "convnext_atto"}, CIFAR_INFO),
        ({"model_name": "convnext_atto", "image_size": [32, 32]}, DIGITS_INFO),
        ({"model_name": "convnextv2_atto"}, CIFAR_INFO),
        ({"model_name": "efficientnet_b0", "norm_layer": "group_norm"}, CIFAR_INFO),
        ({"model_name": "efficientnet_b0", "norm_layer": "group_norm"}, DIGITS_INFO),
        ({"model_name": "mobilenetv2_050", "norm_layer": "group_norm"}, CIFAR_INFO),
        ({"model_name": "nf_resnet26"}, CIFAR_INFO),  # conf/model/nf_resnet26.yaml
        ({"model_name": "resnetv2_50x1_bit"}, CIFAR_INFO),  # conf/model/bit_resnet50.yaml
    ],
    ids=[
        "convnext-cifar10",
        "convnext-digits-resized",
        "convnextv2-cifar10",
        "efficientnet-cifar10",
        "efficientnet-digits",
        "mnv2",
        "nf-resnet-cifar10",
        "bit-cifar10",
    ],
)
def test_timm_cnns_build_without_batchnorm_and_every_module_ruled(kwargs, info) -> None:
    from timm.layers import GroupNormAct

    from dpexp.privacy.capture import unsupported_modules

    model = TimmImageFactory(pretrained=False, image_size=kwargs.pop("image_size", None), **kwargs).build(
        info
    )
    assert model(torch.rand(2, *info.input_shape)).shape == (2, 10)
    modules = list(model.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    assert unsupported_modules(model) == {}  # no module on the torch.func fallback
    if "norm_layer" in kwargs:
        norms = [m for m in modules if isinstance(m, GroupNormAct)]
        assert norms and all(m.num_channels // m.num_groups == 8 for m in norms)  # groups of 8 channels


def test_timm_cnn_keeps_the_task_size_or_resizes() -> None:
    seen = []
    model = TimmImageFactory("convnext_atto", pretrained=False, image_size=[32, 32]).build(DIGITS_INFO)
    model.net.stem.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    model(torch.rand(1, 1, 8, 8))
    native = TimmImageFactory("convnext_atto", pretrained=False, image_size=None).build(CIFAR_INFO)
    native.net.stem.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    native(torch.rand(1, 3, 32, 32))
    assert seen == [(1, 1, 32, 32), (1, 3, 32, 32)] and native.input.size is None


@pytest.mark.parametrize(
    ("kwargs", "info", "message"),
    [
        ({"model_name": "convnext_atto", "image_size": None}, DIGITS_INFO, "cannot run on 8x8 images"),
        ({"model_name": "efficientnet_b0", "image_size": None}, CIFAR_INFO, "has BatchNorm layers"),
        ({"model_name": "convnext_atto", "image_size": "big"}, CIFAR_INFO, "image_size must be"),
        ({"model_name": "convnext_atto", "image_size": [32]}, CIFAR_INFO, "image_size must be"),
        ({"model_name": "convnext_atto", "norm_layer": "batch_norm"}, CIFAR_INFO, "norm_layer must be"),
        (
            {"model_name": "efficientnet_b0", "norm_layer": "group_norm", "group_size": 0},
            CIFAR_INFO,
            "group_size",
        ),
        (
            {"model_name": "efficientnet_b0", "norm_layer": "group_norm", "group_size": 7},
            CIFAR_INFO,
            "timm could",
        ),
    ],
)
def test_timm_factory_refuses_bad_settings(kwargs, info, message) -> None:
    with pytest.raises(ValueError, match=message):
        TimmImageFactory(pretrained=False, **kwargs).build(info)


def test_batchnorm_weights_do_not_fit_group_norm() -> None:
    with pytest.raises(ValueError, match="trained with BatchNorm"):
        TimmImageFactory("efficientnet_b0", pretrained=True, norm_layer="group_norm")


@pytest.mark.parametrize(
    ("option", "narrow"),
    [
        (
            "convnext_atto",
            ["model.image_size=[32,32]", "model.model_kwargs={dims:[8,8,8,8],depths:[1,1,1,1]}"],
        ),
        ("efficientnet_b0", ["model.model_name=test_efficientnet"]),  # the same builder, timm's test widths
    ],
)
def test_private_step_of_timm_cnns(option, narrow, compose_config, tmp_path) -> None:
    """model=convnext_atto / efficientnet_b0 as composed by python -m dpexp.train (narrowed), on digits: one
    private step, no module on the torch.func fallback."""
    import warnings

    from dpexp.config import check_config
    from dpexp.training.loop import run_training

    overrides = [
        f"model={option}", *narrow, "clip=bk", "steps=1", "batch_size=16", "physical_batch_size=8",
        "progress=false", "eval_every=null",
    ]  # fmt: skip
    cfg = compose_config(overrides)
    check_config(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        record = run_training(cfg, tmp_path / "run", {"task": "digits", "model": option})
    assert record["status"] == "completed" and record["steps_done"] == 1 and record["model"] == option
    assert 0.0 <= record["accuracy"] <= 1.0


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_ws_conv_honours_padding_mode(padding_mode) -> None:
    """WSConv2d is nn.Conv2d with the standardised weight, padding mode included (it once padded with zeros
    whatever the mode)."""
    torch.manual_seed(0)
    ws = WSConv2d(3, 4, 3, padding=1, padding_mode=padding_mode)
    plain = nn.Conv2d(3, 4, 3, padding=1, padding_mode=padding_mode)
    with torch.no_grad():
        plain.weight.copy_(standardize_weight(ws.weight, ws.eps))
        plain.bias.copy_(ws.bias)
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(ws(x), plain(x))
